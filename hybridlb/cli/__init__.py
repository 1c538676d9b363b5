"""The ``hybridlb`` command line: every command, and vLLM's ``serve`` spelling (``vllm_args``).

Nothing below the CLI imports it: each command module turns flags into a ``Config`` and
calls into the package that does the work (``launch``, ``engine``, ``bench``, ...).
"""

from __future__ import annotations

import sys

import typer

from hybridlb.cli import vllm_args
from hybridlb.cli.bench import bench_app
from hybridlb.cli.cluster import down, status, up
from hybridlb.cli.model import generate, make_model_command
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
app.command(short_help="Stop a cluster started with `up --detach`.")(down)
app.add_typer(bench_app, name="bench", short_help="Benchmark a running server.")
app.add_typer(render_app, name="render", short_help="Render the cluster for Kubernetes.")


def main() -> None:
    """The ``hybridlb`` command: ``serve`` also takes ``vllm serve``'s spelling (see vllm_args)."""
    args = sys.argv[1:]
    if args[:1] == ["serve"] and not {"-h", "--help"} & set(args):
        try:
            translated, notes = vllm_args.translate(args[1:])
        except vllm_args.FlagError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise SystemExit(2) from None
        for note in notes:
            typer.secho(f"note: {note}", err=True)
        sys.argv[1:] = ["serve", *translated]
    app()


if __name__ == "__main__":
    main()
