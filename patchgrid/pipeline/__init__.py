"""A study's pipeline: its validated specification and study file, its shards and run ids, the
memory plan of its gradient passes, its summary, and one pair typed at the command line through the
sweeps."""
