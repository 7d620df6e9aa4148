"""dflash-export's command line: the options, parsed before torch is imported (the work is
consumers/export/export.py's `run`), so that `--help` answers at once."""

from __future__ import annotations

import click

from dflash.runtime.command_line import command, option, runs_dir_option, target_option


@command("EXPORT", max_content_width=100)
@click.argument("checkpoint")
@click.argument("out_dir", type=click.Path(file_okay=False))
@target_option("Target model folder or .gguf file, to copy its bos/eos token IDs into config.json (else null).",
               required=False, need_tokenizer=False)
@runs_dir_option()
@option("--force", is_flag=True, default=False, help="Replace OUT_DIR if it is not empty.")
@option("--eval-report", default=None, type=click.Path(exists=True, dir_okay=False),
        help="A dflash-eval --json report of this drafter: its tau goes into README.md.")
def main(checkpoint: str, out_dir: str, target: str | None, runs_dir: str, force: bool,
         eval_report: str | None) -> None:
    """Export CHECKPOINT (a step folder, run folder, run ID or 'latest') to OUT_DIR in the
    layout of the DFlash drafters published on Hugging Face."""
    from dflash.consumers.export.export import run

    run(checkpoint, out_dir, target, runs_dir, force, eval_report)


if __name__ == "__main__":
    main()
