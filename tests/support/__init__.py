"""What the tests share, one module per job (fixtures themselves live in the conftest files):

    engines      the tiny models every backend test runs on, the vLLM skip mark, the session's engine pool
    backends     requests at every site and comparisons of engine results
    pairs        pairs from the shipped fact set, and source records written by hand
    effect_rows  synthetic effect rows, made by the library's one definition of a row
    processes    the CLI in real processes, killed with real signals; the warehouse read back
    tiers        the tier of every test (unit, engine, flow, reliability), from what it uses
"""
