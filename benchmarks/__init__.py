"""Side-by-side benchmarks of ckptd against PyTorch (torch.save, DCP) and the raw floors.

Run: ``python -m benchmarks.run --size 1.5GiB --out results.json`` (see ``benchmarks/run.py``).
"""
