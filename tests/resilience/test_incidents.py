"""incidents.jsonl: appended records, a torn last line tolerated, and the timeline `zaya report` shows."""

import json

import pytest

from zaya.cli import main
from zaya.errors import ZayaError
from zaya.resilience.incidents import IncidentLog, read_incidents, timeline


def test_records_append_and_a_torn_last_line_is_left_out(tmp_path):
    log = IncidentLog(tmp_path / "incidents.jsonl")
    log.append({"signal": "hang", "subject": "rank:1", "evidence": ["rank 1: no heartbeat for 4.2 s"],
                "action": "restart", "outcome": "restarting (run 1)"})
    log.append({"event": "recovered", "outcome": "past step 7 again 18.0 s after the hang was detected"})
    with (tmp_path / "incidents.jsonl").open("a") as handle:
        handle.write('{"signal": "oom", "act')  # a writer killed mid-line
    records = read_incidents(tmp_path / "incidents.jsonl")
    assert [r["event"] for r in records] == ["incident", "recovered"]
    assert records[0]["time"].endswith("Z") and records[0]["signal"] == "hang"
    text = timeline(records)
    assert "hang rank:1" in text and "-> restart" in text and "no heartbeat for 4.2 s" in text
    assert "recovered: past step 7" in text


def test_a_broken_line_inside_the_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "incidents.jsonl"
    path.write_text('not json\n{"signal": "nan"}\n')
    with pytest.raises(ZayaError, match=r"incidents\.jsonl:1: not a JSON line"):
        read_incidents(path)


def test_zaya_report_shows_the_timeline_of_a_state_directory(tmp_path, capsys):
    state = tmp_path / "supervisor"
    IncidentLog(state / "incidents.jsonl").append({"signal": "gpu_ecc", "subject": "gpu:1", "action": "cordon_gpu",
                                                  "outcome": "GPU 1 cordoned", "evidence": ["1, 00:5E, 2, 2"]})
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "incidents (1):" in out and "gpu_ecc gpu:1" in out and "cordon_gpu" in out
    assert not (tmp_path / "report").exists()  # no metrics: the timeline alone


def test_zaya_report_puts_the_timeline_in_the_run_report(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0, "lr": 0.01, "batch_size": 8}) + "\n")
    IncidentLog(tmp_path / "incidents.jsonl").append({"signal": "nan", "subject": "step:4", "action": "skip_step",
                                                      "outcome": "update dropped, step counted"})
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "<h2>incidents</h2>" in page and "skip_step" in page
