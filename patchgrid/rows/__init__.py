"""What a study writes: every row shape (pairs, baselines, effects), effect rows from readings,
Parquet files written whole."""
