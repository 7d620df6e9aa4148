"""Two consumer ranks on gloo, as real processes over a TCP rendezvous on loopback."""

import socket
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs

from tests.consumers.dp_common import CFG, rank_batches, union
from tests.harness.spawn import child_env, module_argv
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks

pytestmark = pytest.mark.integration



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_two_ranks_stay_identical_and_equal_single_process_on_the_union(heads, target_dir, tmp_path):
    port = _free_port()
    procs = [subprocess.Popen(module_argv("tests.consumers.dp_worker", str(target_dir), str(tmp_path), str(rank), "2",
                                          str(port)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=child_env())
             for rank in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-3000:]
    r0, r1 = (load_file(tmp_path / f"rank{r}.safetensors") for r in (0, 1))

    # The single-process reference: each step trains on the union of both ranks' batches.
    a, b = rank_batches(heads.spec, 0), rank_batches(heads.spec, 1)
    ref, ref_grad = {}, {}

    def after_step(step, model):
        ref[step] = torch.cat([p.detach().flatten() for p in model.parameters()])
        ref_grad[step] = torch.cat([p.grad.flatten() for p in model.parameters()])

    hooks = Hooks(after_step=after_step)
    with capture_logs():
        state = train(CFG, heads, [union(x, b[i] if i < len(b) else None) for i, x in enumerate(a)], hooks=hooks)

    assert sorted(k for k in r0 if k.startswith("step")) == [f"step{s}" for s in range(1, 5)]  # 4 steps, incl. the empty one
    near_eps = torch.zeros_like(ref[1], dtype=torch.bool)
    for s in range(1, 5):
        assert torch.equal(r0[f"step{s}"], r1[f"step{s}"]), f"ranks differ after step {s}"
        assert torch.equal(r0[f"grad{s}"], r1[f"grad{s}"])
        # The averaged gradient is the union's gradient up to float summation order; from
        # step 2 on it is taken at weights that differ where Adam moved near-eps ones (below),
        # which some CPUs' kernels turn into more than float rounding. A wrong reduction is O(1).
        err = float((r0[f"grad{s}"] - ref_grad[s]).norm() / ref_grad[s].norm())
        limit = 1e-5 if s == 1 else 1e-4
        assert err < limit, f"step {s}: gradient differs from single-process by {err:.2e} (relative)"
        # Parameters: Adam divides by sqrt(v) + eps, so where a gradient was ever near eps
        # (1e-8) a 1e-9 difference moved that weight by a fraction of lr, and its moments
        # carry the difference on; allow up to lr per step there, nothing more elsewhere.
        near_eps |= ref_grad[s].abs() < 1e-6
        torch.testing.assert_close(r0[f"step{s}"][~near_eps], ref[s][~near_eps], rtol=1e-4, atol=1e-5,
                                   msg=f"step {s}")
        assert all(float(d) <= s * CFG.lr for d in (r0[f"step{s}"] - ref[s])[near_eps].abs())
    assert not torch.equal(r0["step3"], r0["step4"])  # the empty step on rank 1 still trained rank 0's batch
    assert int(r0["tokens"]) == int(r1["tokens"]) == state.tokens
    # Both ranks recorded both ranks' samples (gathered every step), each exactly once.
    want = sorted(s for rank in (0, 1) for batch in rank_batches(heads.spec, rank) for s in batch.samples)
    for r in (r0, r1):
        assert torch.nonzero(r["record0"]).flatten().tolist() == want and set(r["record0"][want].tolist()) == {1}
