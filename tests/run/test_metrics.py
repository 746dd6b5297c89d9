import json
import logging
import sys

from grpoflow.run.metrics import MetricsLogger


def test_without_tensorboard_the_default_sink_is_an_info_line_not_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level(logging.INFO, logger="grpoflow"):
        metrics = MetricsLogger(tmp_path, report_to=["tensorboard"], total_steps=1, show_progress=False)
        metrics.log(1, {"reward": 0.5, "kl": float("nan")})
        metrics.close()
    (record,) = [r for r in caplog.records if "TensorBoard is not installed" in r.getMessage()]
    assert record.levelno == logging.INFO and "grpoflow[logging]" in record.getMessage()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["kl"] is None


def test_log_lines_print_above_the_progress_bar(tmp_path, capsys):
    metrics = MetricsLogger(tmp_path, report_to=[], total_steps=2, show_progress=True)
    try:
        root = logging.getLogger()
        assert any(type(h).__name__ == "_TqdmLoggingHandler" for h in root.handlers)
    finally:
        metrics.close()
    assert not any(type(h).__name__ == "_TqdmLoggingHandler" for h in logging.getLogger().handlers)
