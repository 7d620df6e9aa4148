"""dflash-consume on a local synthetic stream: run folder, logs, resume, refusal, SIGTERM."""

import json
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from tests.harness.tiny import MASK_ID
from dflash.consumers.process.consume_command import main

pytestmark = pytest.mark.integration

STEP_FIELDS = ("step", "loss", "acc", "streak", "lr", "noise", "tokens_per_s", "batches_per_s", "queue",
               "epoch", "eta_s")


def _args(target_dir, runs, *extra):
    return ["--target", str(target_dir), "--runs-dir", str(runs), "--draft-layers", "2", "--target-layers", "1,2",
            "--block-size", "4", "--anchors", "6", "--mask-token-id", str(MASK_ID), "--synthetic-seq-len", "32",
            "--synthetic-seqs", "2", "--instance", "test-cpu", *extra]


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_help_explains_every_option():
    out = CliRunner().invoke(main, ["--help"]).output
    for p in main.params:
        if p.name == "help":
            continue
        assert p.help, f"--{p.name} has no help text"
        assert p.envvar in out, p.name


def test_local_run_writes_its_folder_then_resume_latest_continues_or_refuses(target_dir, tmp_path):
    runs = tmp_path / "runs"
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "6", "--save-every", "3",
                                       "--total-steps", "8"))
    assert r.exit_code == 0, r.output
    (first,) = [p for p in runs.iterdir() if p.name != "latest"]
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step-3", "step-6"]
    assert json.loads((first / "run.json").read_text())["config"]["train"]["block_size"] == 4
    steps = [e for e in _lines(first / "logs" / "consumer-test-cpu.jsonl") if e["event"] == "train.step"]
    assert [e["step"] for e in steps] == list(range(1, 7))
    assert all(k in steps[-1] for k in STEP_FIELDS) and steps[-1]["run_id"] == first.name

    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "2", "--resume", "latest",
                                       "--block-size", "8"))
    assert r.exit_code == 2
    assert "block_size: 4 -> 8" in r.output and "--force" in r.output

    # Packing settings may change on resume; the training signal may not.
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "2", "--resume", "latest",
                                       "--total-steps", "8", "--synthetic-seqs", "3"))
    assert r.exit_code == 0, r.output
    newest = (runs / "latest").resolve()
    assert newest != first and (newest / "checkpoints" / "step-8").is_dir()
    run_json = json.loads((newest / "run.json").read_text())
    assert run_json["parent_run"] == first.name and run_json["resumed_from"].endswith("step-6")
    events = _lines(newest / "logs" / "consumer-test-cpu.jsonl")
    assert [e["step"] for e in events if e["event"] == "train.step"] == [7, 8]  # no old steps in the new file


def test_loss_dpace_trains_is_recorded_and_a_resume_with_ce_is_refused(target_dir, tmp_path):
    runs = tmp_path / "runs"
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "2", "--loss", "dpace",
                                       "--dpace-alpha", "0.3"))
    assert r.exit_code == 0, r.output
    (run,) = [p for p in runs.iterdir() if p.name != "latest"]
    state = json.loads((run / "checkpoints" / "step-2" / "state.json").read_text())
    assert (state["signal"]["loss"], state["signal"]["dpace_alpha"]) == ("dpace", 0.3)
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "2", "--resume", "latest"))
    assert r.exit_code == 2 and "loss: 'dpace' -> 'ce'" in r.output and "--force" in r.output
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "1", "--loss", "dpace",
                                       "--gamma", "3"))
    assert r.exit_code == 2 and "--gamma" in r.output and "--loss dpace" in r.output, r.output


def test_bad_input_exits_with_one_line(target_dir, tmp_path):
    args = _args(target_dir, tmp_path, "--synthetic-batches", "1")
    args[args.index("--mask-token-id") + 1] = "9999"
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "mask token id 9999 outside the vocabulary" in r.output


@pytest.mark.timeout(120)
def test_sigterm_finishes_the_step_and_writes_a_final_checkpoint(target_dir, tmp_path):
    runs = tmp_path / "runs"
    code = "import sys, torch; torch.set_num_threads(1); from dflash.consumers.process.consume_command import main; main()"
    p = subprocess.Popen([sys.executable, "-c", code, *_args(target_dir, runs, "--synthetic-batches", "100000",
                                                             "--save-every", "0")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Wait for training to be under way: a SIGTERM before the handler is set kills the
    # process (-15), which is not what this checks. A deadline for a hang, with room for
    # a loaded machine (the imports alone take seconds of CPU).
    deadline, seen = time.monotonic() + 180, []
    for line in p.stdout:
        seen.append(line)
        if '"train.step"' in line and '"step": 3' in line:
            break
        if time.monotonic() > deadline:
            p.kill()
            pytest.fail("no train.step 3 within 180 s: " + "".join(seen)[-2000:])
    p.send_signal(signal.SIGTERM)
    out = p.stdout.read()
    assert p.wait(timeout=60) == 0, out[-2000:]
    (run,) = [d for d in runs.iterdir() if d.name != "latest"]
    end = [e for e in _lines(run / "logs" / "consumer-test-cpu.jsonl") if e["event"] == "train.end"][0]
    assert end["reason"] == "stop" and (run / "checkpoints" / f"step-{end['step']}").is_dir()


def test_eval_options_refuse_bad_input_naming_it(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    r = CliRunner().invoke(main, _args(target_dir, tmp_path / "runs", "--synthetic-batches", "2",
                                       "--eval-prompts", str(prompts)))
    assert r.exit_code == 2 and "--eval-prompts" in r.output and "--eval-every" in r.output
    # This target folder has no tokenizer files: real tau cannot read prompts.
    r = CliRunner().invoke(main, _args(target_dir, tmp_path / "runs", "--synthetic-batches", "2",
                                       "--eval-every", "1", "--eval-prompts", str(prompts)))
    assert r.exit_code == 2 and "has no tokenizer" in r.output, r.output


def test_eval_prompts_name_a_bad_row(tmp_path):
    from dflash.tools.tiny import tiny_target

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"no_prompt_here": 1}\n')
    args = ["--target", str(tiny_target()), "--runs-dir", str(tmp_path / "runs"), "--draft-layers", "1",
            "--block-size", "4", "--anchors", "6", "--synthetic-seq-len", "32", "--synthetic-batches", "2",
            "--eval-every", "1", "--eval-prompts", str(prompts)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "prompts.jsonl:2" in r.output, r.output
