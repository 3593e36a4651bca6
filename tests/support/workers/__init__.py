"""Scripts the tests launch by path (`python tests/support/workers/x.py ...`, or torchrun): each puts tests/ on
`sys.path` and imports the support package."""
