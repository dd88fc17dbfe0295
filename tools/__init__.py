"""Test and demo tooling kept out of the runtime packages: the `.nemo` writer and the demo model's builder.

Not installed with the distribution; import it from a clone's root (the tests, `bench/` and
`python -m tools.make_demo_checkpoint` do).
"""
