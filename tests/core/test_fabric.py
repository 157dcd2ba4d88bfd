"""The Fabric example (``lit_slowcal.fabric``, PeriodicAveragingFabricStrategy) on two processes equals the
plain torch loop."""

from test_averaging import assert_close, run_example


def test_fabric_example_on_two_processes_equals_the_plain_loop(tmp_path):
    fabric = run_example("fabric_loop.py", tmp_path, "--processes=2", "--dtype=float64")
    plain = run_example("torch_loop.py", tmp_path, "--processes=1", "--machines=2", "--dtype=float64")
    assert_close(fabric, plain, 1e-12)
