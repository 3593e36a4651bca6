"""Test support (importable as `support.x`; tests/conftest.py puts tests/ on the path): the tiny models and their
runs (`models`, `trainers`, `specs`, `states`, `callbacks`, `env`), launches of real processes (`launches`,
`fork_launch`; the memory tier's runs: `flash`; the preemption worker's: `preemption`), faults (`faulty_store`: a
real store with fault hooks; `faults`: the rest, and `record_fault`) and recordings (`records`), servers
(`s3_server`, `s3_faults`), comparisons (`parity`, `parity_trainers`), readers (`format_reader`, `mapped_files`,
`loopback`, `codecs`), text for TRL's trainers (`text`), hostile folders (`hostile`). `workers/` holds the scripts
launched by path."""
