"""The exactness contract's checks (``sweep.contract``): bit for bit, except the diagnostics within 1e-12 relative."""

from lit_slowcal.experiments.sweep.contract import DIAGNOSTICS_RTOL, MEASURED, csv_differences, differences


def test_training_and_test_metrics_must_be_equal_bit_for_bit_and_diagnostics_within_1e_12():
    a = {"test_acc": 0.9124, "train_loss": 0.5, "train_objective": 0.30000000000000004, "dispersion": 1.0}
    assert differences(a, dict(a)) == []
    assert differences(a, {**a, "train_objective": 0.3}) == []  # one ulp
    assert differences(a, {**a, "dispersion": 1.0 + 0.9 * DIAGNOSTICS_RTOL}) == []
    assert differences(a, {**a, "dispersion": 1.0 + 2 * DIAGNOSTICS_RTOL}) == [
        f"dispersion: 1.0 != {1.0 + 2 * DIAGNOSTICS_RTOL!r}"
    ]
    assert differences(a, {**a, "test_acc": 0.9124000000000001}) == ["test_acc: 0.9124 != 0.9124000000000001"]
    assert differences(a, {**a, "train_objective": float("nan")}) == ["train_objective: 0.30000000000000004 != nan"]
    assert differences({**a, "test_loss": 1.0}, a) == ["test_loss: 1.0 != None"]


def test_metrics_csv_cells_are_compared_as_text_except_the_diagnostics():
    head = "epoch,step,test_acc,train_objective\n"
    a = head + "0,9,0.5,0.30000000000000004\n"
    assert csv_differences(a, head + "0,9,0.5,0.3\n") == []
    assert csv_differences(a, head + "0,9,0.50,0.30000000000000004\n") == ["row 1 test_acc: '0.5' != '0.50'"]
    assert csv_differences(a, head + "0,9,0.5,0.3000001\n") == [
        "row 1 train_objective: '0.30000000000000004' != '0.3000001'"
    ]
    assert csv_differences(a, a + "0,19,0.6,0.2\n")[0].startswith("columns or rows differ")
    assert csv_differences(a, "epoch,step,test_acc\n0,9,0.5\n")[0].startswith("columns or rows differ")


def test_measured_seconds_are_outside_the_contract():
    """``train_s`` (a fit's measured seconds) differs between two runs of one trial, and a stacked trial logs none."""
    assert MEASURED == {"train_s"}
    assert differences({"test_acc": 0.5, "train_s": 1.25}, {"test_acc": 0.5}) == []
    assert differences({"test_acc": 0.5, "train_s": 1.25}, {"test_acc": 0.6, "train_s": 1.5}) == [
        "test_acc: 0.5 != 0.6"
    ]
    single = "epoch,step,test_acc,train_s\n0,9,0.5,0.125\n"
    assert csv_differences(single, "epoch,step,test_acc\n0,9,0.5\n") == []
    assert csv_differences(single, "epoch,step,test_acc\n0,9,0.6\n") == ["row 1 test_acc: '0.5' != '0.6'"]
