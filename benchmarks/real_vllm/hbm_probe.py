"""HBM copy bandwidth on this GPU (torch only): a 4 GiB device-to-device copy, best of 10, and a read-only sum."""
import json, sys, torch
n = 1 << 31  # bf16 elements: 4 GiB
a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
b = torch.empty_like(a)
res = {"gpu": torch.cuda.get_device_name(), "bytes": 2 * n}
for label, fn, moved in (("copy", lambda: b.copy_(a), 2 * 2 * n), ("sum_read", lambda: a.sum(dtype=torch.float32), 2 * n)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    res[label + "_gb_s"] = moved / best / 1e9
print(json.dumps(res))
json.dump(res, open(sys.argv[1], "w"), indent=1)
