"""memory.py: the rows of KV cache that fit the room a process has (a container's limit included), what a smaller
budget decodes, and training on a thread of its own."""
import sys
import threading

import pytest
import torch

import engine
import memory


def test_fewer_rows_decode_at_once_when_less_memory_is_free():
    gib = 2 ** 30
    assert memory.rows_that_fit(64, gib, 100 * gib) == 64
    assert memory.rows_that_fit(64, gib, 40 * gib) == 38  # 40 GiB less the 2 GiB headroom
    assert memory.rows_that_fit(64, gib, 20 * gib) == 18
    assert memory.rows_that_fit(64, gib, 2 * gib) == 0


def fake_cgroup(root, folder, files):
    (root / folder).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / folder / name).write_text(text)


def test_a_containers_memory_limit_is_the_free_memory_it_leaves(tmp_path, monkeypatch):
    gib = 2 ** 30
    # a container on cgroup v2: 6 GiB limit, 2 GiB charged, of it 0.5 GiB page cache the kernel can drop
    v2 = tmp_path / "v2"
    fake_cgroup(v2, ".", {"cgroup.controllers": "cpu memory", "memory.max": f"{6 * gib}\n",
                          "memory.current": f"{2 * gib}\n", "memory.stat": f"anon 1\ninactive_file {gib // 2}\n"})
    (tmp_path / "v2.cgroup").write_text("0::/\n")
    assert memory.cgroup_room(tmp_path / "v2.cgroup", str(v2)) == 4.5 * gib
    # cgroup v1, a job without a limit inside a parent with 8 GiB: the parent's limit binds
    v1 = tmp_path / "v1"
    fake_cgroup(v1, "memory", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1",
                               "memory.stat": "total_inactive_file 0\n"})
    fake_cgroup(v1, "memory/batch", {"memory.limit_in_bytes": f"{8 * gib}", "memory.usage_in_bytes": f"{3 * gib}",
                                     "memory.stat": f"total_inactive_file {gib}\n"})
    fake_cgroup(v1, "memory/batch/job7", {"memory.limit_in_bytes": "9223372036854771712",
                                          "memory.usage_in_bytes": f"{gib}", "memory.stat": "total_inactive_file 0\n"})
    (tmp_path / "v1.cgroup").write_text("5:cpu,cpuacct:/batch/job7\n4:memory:/batch/job7\n0::/\n")
    assert memory.cgroup_room(tmp_path / "v1.cgroup", str(v1)) == 6 * gib
    # no limit anywhere: the host's MemAvailable alone
    (tmp_path / "free.cgroup").write_text("4:memory:/\n")
    assert memory.cgroup_room(tmp_path / "free.cgroup", str(v1)) is None
    monkeypatch.setattr(memory, "cgroup_room", lambda: gib)
    assert memory.free_memory(torch.device("cpu")) == gib


def test_a_smaller_kv_budget_decodes_fewer_rows_and_says_so(tiny, capsys):
    model = tiny[0]
    per_row = memory.kv_bytes_per_row(model.config, 1024, torch.float32)
    assert memory.cache_rows(model, 64, "cpu", torch.float32, 1024, budget=64 * per_row) == 64
    assert memory.cache_rows(model, 64, "cpu", torch.float32, 1024, budget=5.5 * per_row) == 5
    assert "decoding 5 rows at once" in capsys.readouterr().out
    assert memory.cache_rows(model, 64, "cpu", torch.float32, 1024) == 64  # no budget: a CPU cache grows as used
    with pytest.raises(ValueError, match="--kv-cache-gb"):
        memory.cache_rows(model, 64, "cpu", torch.float32, 1024, budget=per_row / 2)


def test_training_runs_on_a_thread_of_its_own_whose_errors_reach_the_caller():
    # on the CPU glibc gives that thread its own heap (docs/training.md, memory); elsewhere nothing changes
    assert memory.on_training_thread("cpu", threading.current_thread) is not threading.main_thread()
    assert memory.on_training_thread("cuda", threading.current_thread) is threading.main_thread()
    assert memory.on_training_thread("cpu", max, 2, 7) == 7
    with pytest.raises(SystemExit):  # --stop-after exits from inside SFT
        memory.on_training_thread("cpu", sys.exit, 0)


def test_a_gpus_free_memory_counts_what_the_allocator_caches_unused(monkeypatch):
    """After GRPO steps PyTorch's allocator keeps freed blocks: counted as taken, a rollout would decode fewer rows
    than fit, or none. 30 GB free on the card plus 12 of the 20 GB reserved that no tensor uses: 42 GB."""
    gb = 10 ** 9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gb, 80 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 20 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 8 * gb)
    assert memory.free_memory(torch.device("cuda:0")) == 42 * gb
    per_row = gb
    assert memory.rows_that_fit(64, per_row, memory.free_memory(torch.device("cuda:0"))) == 39  # less the headroom


def test_the_headroom_beside_the_cache_holds_a_prefill_at_its_bound():
    assert memory.CACHE_HEADROOM >= 2 * engine.PREFILL_BYTES
