"""My loss is NaN: the example of docs/nan_workflow.md. A masked mean pooling
divides by the mask's sum; one sample of the batch has an all-zero mask (dirty
data), so its pooled vector is 0 / 0 and the loss is NaN.

    python docs/examples/nan_example.py
"""

import warnings

import torch

import nanfree


class MaskedMean(torch.nn.Module):
    def forward(self, x, mask):
        return (x * mask).sum(1) / mask.sum(1)  # an all-zero mask: 0 / 0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 8)
        self.pool = MaskedMean()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.head(self.pool(torch.tanh(self.encoder(x)), mask[..., None]))


def batch():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8)
    mask = torch.ones(4, 5)
    mask[2] = 0  # the dirty sample
    return x, mask


def main():
    net = Net()
    x, mask = batch()
    print("loss:", net(x, mask).pow(2).mean().item())

    print("\n== torch.autograd.detect_anomaly()")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its traceback of the forward call
        try:
            with torch.autograd.detect_anomaly():
                net(x, mask).pow(2).mean().backward()
        except RuntimeError as error:
            print(f"RuntimeError: {error}")

    print("\n== nanfree.debug.detect_anomaly(model=net)")
    net.zero_grad()
    try:
        with nanfree.debug.detect_anomaly(model=net):
            net(x, mask).pow(2).mean().backward()
    except nanfree.debug.NonFiniteError as error:
        print(f"NonFiniteError: {error}")

    print("\n== nanfree.optim.FiniteGuard(..., locate=True)")
    guard = nanfree.optim.FiniteGuard(torch.optim.AdamW(net.parameters(), fused=True),
                                      locate=True)
    before = [p.detach().clone() for p in net.parameters()]

    def closure():
        guard.zero_grad()
        loss = net(x, mask).pow(2).mean()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.step(closure)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
    print(f"step skipped: {guard.skipped_steps} skipped, parameters unchanged: {unchanged}")
    for w in caught:
        if "detect_anomaly: code compiled" not in str(w.message):
            print(f"{w.category.__name__}: {w.message}")


if __name__ == "__main__":
    main()
