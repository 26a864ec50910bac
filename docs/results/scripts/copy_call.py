"""The bench's floor copy (2 GiB float32, torch), twice, for ncu."""
import torch
a = torch.ones(2**29, device="cuda"); b = torch.empty_like(a)
for _ in range(2):
    b.copy_(a)
torch.cuda.synchronize()
