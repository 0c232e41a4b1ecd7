"""`python -m kvloop.bench.pd_transfer` runs the proxy flow between two real workers (here
simulated ones: modelled bytes) and reports the decode side's measured loads."""

import pytest

from kvloop.bench import pd_transfer

pytestmark = pytest.mark.processes


def test_smoke_reports_every_block_moved(capsys):
    pd_transfer.main(["--model", "sim", "--lengths", "40", "--repeats", "1",
                      "--transports", "tcp"])
    out = capsys.readouterr().out
    row = [line.split() for line in out.splitlines() if line.split()[:1] == ["40"]]
    assert len(row) == 1, out
    tokens, blocks, mb, load_ms, per_block, _ = row[0]
    assert (tokens, blocks) == ("40", "3")
    # the simulator's blocks: SmolLM2's geometry at bf16, 23,040 bytes per token
    assert float(mb) == pytest.approx(3 * 16 * 23040 / 1e6, abs=0.01)
    assert float(load_ms) > 0 and float(per_block) > 0
