"""kvtier bench transfer: argument checks, the control cases and the report (no GPU needed)."""

import pytest

from kvtier import cli
from kvtier.bench import transfer


def test_bad_arguments_are_refused_before_anything_runs(capsys):
    assert cli.main(["bench", "transfer", "--cases", "mla-p1,nope"]) == 2
    assert "unknown case(s) nope" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--mixed", "nvidia-tma"]) == 2
    assert "LOAD_ENGINE+BACKUP_ENGINE" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--mixed", "a+"]) == 2
    assert cli.main(["bench", "transfer", "--mib", "0"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "transfer", "--order", "backwards"])


@pytest.mark.parametrize("case", [c for c in transfer.CASES if c.startswith("flat-")])
def test_flat_cases_are_one_chunk_per_page(case):
    spec = transfer.CASES[case]
    assert spec.num_layers == 1 and spec.num_components == 1
    assert spec.chunk_bytes == spec.page_bytes and spec.chunk_bytes % 16 == 0
    assert case not in transfer.DEFAULT_CASES


def test_parse_value():
    assert transfer.parse_value("4") == 4 and transfer.parse_value("0.5") == 0.5
    assert transfer.parse_value("False") is False and transfer.parse_value("x") == "x"


def test_render_names_the_order_and_mixed_rows():
    row = {"case": "mla-p1", "chunk_bytes": 1152, "engine": "a+b", "config": {},
           "mode": "all", "direction": "both", "ctas": 4, "gbps": 60.0, "ratio": 0.6}
    data = {"env": {"gpu": "G"}, "ceiling": {"h2d": 50.0, "d2h": 50.0, "both": 100.0},
            "host_backing": "thp", "mib": 256, "order": "sequential", "results": [row]}
    out = transfer.render(data)
    assert "pages in sequential order" in out
    assert "| a+b " in out and "60.0%" in out
