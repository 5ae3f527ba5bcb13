"""The docs are checked: their commands parse, their Python examples run, their column lists are the views'."""
