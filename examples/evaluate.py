"""Read a tinyvllm output Parquet with plain pyarrow and print a few figures.

    python examples/evaluate.py out/prompts.parquet
"""

import json
import sys

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq


def main(path: str) -> None:
    table = pq.read_table(path)
    meta = {k.decode(): json.loads(v) for k, v in (table.schema.metadata or {}).items() if k.startswith(b"tinyvllm.")}
    ok = table.filter(pc.not_equal(table["finish_reason"], "error"))
    print(f"file:          {path}")
    model, backend, batching = (meta.get(f"tinyvllm.{k}") for k in ("model", "backend", "batching"))
    print(f"model:         {model} ({backend}, {batching})")
    print(f"rows:          {table.num_rows}")
    print(f"errors:        {table.num_rows - ok.num_rows}")
    if ok.num_rows:
        print(f"mean completion tokens: {pc.mean(ok['completion_tokens']).as_py():.1f}")
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = ok[name].drop_null().to_numpy()
        if len(values):
            p50, p90 = np.percentile(values, [50, 90])
            print(f"{name:<8} p50 {p50:9.1f}  p90 {p90:9.1f}")
    counts = pc.value_counts(table["finish_reason"]).to_pylist()
    print("finish reasons: " + ", ".join(f"{c['values']}={c['counts']}" for c in counts))
    for row in table.filter(pc.equal(table["finish_reason"], "error")).select(["id", "error"]).to_pylist()[:5]:
        print(f"  error {row['id']}: {row['error']}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/evaluate.py OUTPUT.parquet")
    main(sys.argv[1])
