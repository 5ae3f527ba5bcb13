"""The methods beside exact patching: attribution patching and its QK fix, the graph circuits are
drawn on, edge attribution, circuits, and attention patterns read from an engine."""
