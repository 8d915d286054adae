"""`bench/report.py` on the record shapes the groups write (a plain test: it runs under `make test`)."""

from __future__ import annotations

import json

from bench.report import main


def _benchmark(name, group, **extra):
    info = {
        "group": group,
        "model": "embedded",
        "backend": "cpu",
        "figures": {f"{group} figure": {"value": 1.5, "target": ">= 1", "met": True, "unit": "x"}},
        "variants": {},
        "memory": {},
        "notes": [],
    }
    info.update(extra)
    return {"name": name, "extra_info": info}


def test_several_result_files_make_one_report_of_every_record_shape(tmp_path, capsys):
    rank = {"syncs": {"total": 20, "vlft_own": 0, "by_owner": {"transformers": 20}, "top_sites": {"x.py:1 f": 4}}}
    first = {
        "machine_info": {"cpu": {"brand_raw": "Test CPU", "count": 2}},
        "commit_info": {"id": "abc"},
        "benchmarks": [
            _benchmark(
                "test_dispatch",
                "dispatch",
                dispatch={
                    "lora": {"hook_calls": 0, **rank},
                    "lora, 2 processes": [{"rank": 0, **rank}, {"rank": 1, **rank}],
                },
            ),
            _benchmark("test_guard", "guard", copied={"none": 0}, adapter_parameters=10),
            _benchmark("test_step", "train_step", variants={"lora": {"median_s": 0.04, "samples": 3}}),
        ],
    }
    second = {
        "benchmarks": [
            _benchmark(
                "test_memory_nf4",
                "memory",
                memory={"nf4": {"peak_bytes": 2**20, "step_bytes": 2**19, "measure": "live"}},
            )
        ]
    }
    paths = []
    for i, data in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(data))
    assert main(["report.py", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "machine Test CPU, 2 CPUs" in out
    for row in (
        "| dispatch | embedded | dispatch figure | 1.500x",
        "| guard | embedded | guard figure",
        "| memory | embedded | nf4 | 1.0 MiB",
        "| embedded | lora, 2 processes, rank 1 | - | 20 | 0 |",
        "| train_step | embedded | lora | 40.0 ms",
    ):
        assert row in out, row
