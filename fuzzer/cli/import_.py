"""``fuzz import``: slices of a production trace become seed traces in a corpus folder."""

from __future__ import annotations

import click

from fuzzer.cli._console import out
from fuzzer.formats import FORMATS
from fuzzer.formats.mooncake import DEFAULT_BLOCK_SIZE
from fuzzer.formats.seeds import DEFAULT_WINDOW, import_file, write


@click.command("import")
@click.argument("trace_file", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True,
              help="Format of FILE: Mooncake JSONL, Azure or BurstGPT CSV ('auto' looks at the file).")
@click.option("--window", type=click.IntRange(min=1), default=DEFAULT_WINDOW, show_default=True,
              help="Requests per seed trace.")
@click.option("--start", type=click.IntRange(min=0), default=0, show_default=True,
              help="Index (in arrival order) of the first request of the first window.")
@click.option("--windows", "count", type=click.IntRange(min=1), default=1, show_default=True,
              help="Consecutive windows to import, one seed trace each.")
@click.option("--block-size", type=click.IntRange(min=1), default=DEFAULT_BLOCK_SIZE, show_default=True,
              help="Prompt tokens per Mooncake hash id (512 in AIPerf and the FAST'25 traces; 16 in some).")
@click.option("--out", "out_dir", default="corpus", show_default=True, type=click.Path(file_okay=False),
              help="Folder to write the seed traces into.")
def command(trace_file, fmt, window, start, count, block_size, out_dir) -> None:
    """Import windows of a production trace (Mooncake, Azure, BurstGPT) as seed traces.

    Each window of consecutive requests becomes one trace: arrival gaps kept (the
    first request at 0 ms), prompt and output lengths kept, and requests whose
    Mooncake hash_ids start alike share a prefix of the blocks they have in common.

    \b
    Example:
        fuzz import conversation_trace.jsonl --window 32 --windows 4
        fuzz import AzureLLMInferenceTrace_conv.csv --start 1000 --out corpus/
        fuzz campaign --corpus corpus/
    """
    found, total, traces = import_file(trace_file, fmt=fmt, window=window, start=start, count=count,
                                       block_size=block_size)
    paths = write(traces, out_dir)
    out.print(f"read {total} requests from {trace_file} ({found}); wrote {len(paths)} seed trace(s):")
    for path, t in zip(paths, traces):
        groups = f", {len(t.prefixes)} prefix group(s)" if t.prefixes else ""
        out.print(f"  {path}: {len(t.requests)} requests over {t.duration_ms() / 1000:.1f} s{groups}")
    out.print("next:")
    out.print(f"  fuzz replay {paths[0]} --runs 3")
    out.print(f"  fuzz campaign --corpus {out_dir}")
