"""``fuzz export ID --format mooncake``: the finding's trace as Mooncake JSONL, with the command
that replays it in AIPerf."""

from __future__ import annotations

from pathlib import Path

from fuzzer.cli._console import err, out
from fuzzer.errors import OutputError
from fuzzer.formats import mooncake
from fuzzer.store import Store


def export_mooncake(db_path: str, finding_id: str, out_dir: str, block_size: int) -> None:
    with Store.open(db_path, create=False) as store:
        finding = store.get_finding(finding_id)
        trace = store.get_trace(finding.minimized_trace_hash or finding.trace_hash)
    text = mooncake.dumps(trace, block_size=block_size)
    folder = Path(out_dir) / str(finding.id)
    path = folder / "trace.mooncake.jsonl"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    which = "minimized" if finding.minimized_trace_hash else "original"
    out.print(f"wrote {path}: {len(trace.requests)} requests ({which} trace of finding {finding.id}, "
              f"{block_size} tokens per hash id)")
    dropped = mooncake.dropped_fields(trace)
    if dropped:
        err.print(f"note: Mooncake JSONL has no field for {', '.join(dropped)}; a replay of this file sends "
                  "streaming completions without them")
    out.print("replay it with AIPerf (fixed schedule: the timestamps are the send times):")
    out.print(f"  aiperf profile -m MODEL --url http://HOST:PORT --endpoint-type completions --streaming "
              f"--input-file {path} --custom-dataset-type mooncake_trace --isl-block-size {block_size} --fixed-schedule")
    out.print("or with vLLM's benchmark (timed_trace: timestamps in ms, so a 0.001 multiplier to seconds):")
    out.print(f"  vllm bench serve --model MODEL --base-url http://HOST:PORT --dataset-name timed_trace "
              f"--dataset-path {path} --num-prompts {len(trace.requests)} --self-timed "
              f"--timed-trace-chunk-hash-size {block_size} --timed-trace-sec-multiplier 0.001 --ignore-eos")
    out.print(f"  fuzz import {path} --block-size {block_size} --out corpus/   # back into a seed trace")
