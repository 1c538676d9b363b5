"""The ``hybridlb`` command line: every command, and vLLM's ``serve`` spelling (``vllm_args``).

Nothing below the CLI imports it: each command module turns flags into a ``Config`` and
calls into the package that does the work (``launch``, ``engine``, ``bench``, ...).
"""

from __future__ import annotations

import gc
import sys

import typer

from hybridlb.cli import vllm_args
from hybridlb.cli.bench import bench_app
from hybridlb.cli.cluster import down, scale, status, up
from hybridlb.cli.model import generate, make_model_command
from hybridlb.cli.problems import Refusal
from hybridlb.cli.render import render_app
from hybridlb.cli.serve import SERVE_HELP, plan, serve

# Plain help (no rich panels): it wraps at any terminal width instead of cutting option names.
app = typer.Typer(add_completion=False, no_args_is_help=True, help="Data-parallel LLM serving.",
                  pretty_exceptions_enable=False, rich_markup_mode=None)
app.command("make-model", short_help="Write a random-weight checkpoint (offline).")(make_model_command)
app.command(short_help="Generate offline, in this process.")(generate)
app.command(help=SERVE_HELP, short_help="Serve this node, no Ray (vLLM's flags work).")(serve)
app.command(short_help="Print the rank map, or every problem with its fix.")(plan)
app.command(short_help="Place the cluster on Ray and serve until Ctrl-C.")(up)
app.command(short_help="A cluster's actors (NAME) or one server's view (--url).")(status)
app.command(short_help="Resize a running one-node cluster (its ranks).")(scale)
app.command(short_help="Stop a cluster started with `up --detach`.")(down)
app.add_typer(bench_app, name="bench", short_help="Benchmark a running server.")
app.add_typer(render_app, name="render", short_help="Render the cluster for Kubernetes.")

# What typer raises for a value it cannot parse: click's UsageError (typer >= 0.20 carries a copy of click).
USAGE_ERROR = next(kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "UsageError")


def main() -> None:
    """The ``hybridlb`` command: ``serve`` also takes ``vllm serve``'s spelling (see vllm_args).
    A command's ``Refusal`` ends here: ``error: ...`` (every problem found), exit 2."""
    args = sys.argv[1:]
    problems: list[str] = []
    if args[:1] == ["serve"] and not {"-h", "--help"} & set(args):
        translated, notes, problems = vllm_args.translate_all(args[1:], _serve_flags())
        for note in notes:
            typer.secho(f"note: {note}", err=True)
        sys.argv[1:] = ["serve", *translated]
    try:
        if problems:
            raise SystemExit(_serve_despite(problems))
        app()
    except Refusal as refusal:
        refusal.show()
        raise SystemExit(refusal.exit_code) from None
    finally:
        gc.freeze()  # the interpreter's last collection would walk every object of its modules, for nothing


def _serve_despite(problems: list[str]) -> int:
    """``serve`` with flags refused: they ride in the context's obj, for ``serve`` to list with the
    config's and the model's problems; a value typer refuses while parsing joins the list here."""
    try:
        return app(obj=problems, standalone_mode=False)
    except USAGE_ERROR as exc:
        raise Refusal([*problems, exc.format_message()]) from None


def _serve_flags() -> set[str]:
    """Every flag ``hybridlb serve`` takes (the others in a vLLM command line are problems)."""
    command = typer.main.get_command(app).commands["serve"]
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


if __name__ == "__main__":
    main()
