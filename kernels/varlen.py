"""The varlen batch of the recurrent ops (kernels/gated_delta.py, causal_conv.py, ssd_scan.py):
several requests' tokens packed in one [T, ...] tensor, request n owning rows
cu_seqlens[n]:cu_seqlens[n + 1], its recurrent state at state_slots[n] of a slot pool that lives
beside the paged KV. has_initial_state[n] False starts request n from zeros (its first prefill
chunk) instead of what its slot holds; every request's final state is written back to its slot.
A request's prefill may so arrive in several chunks, each starting from where the last stopped."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Varlen:
    cu_seqlens: torch.Tensor  # [N + 1] int64, from 0 to T, non-decreasing
    state_slots: torch.Tensor  # [N] int64, distinct slots of the pool
    has_initial_state: torch.Tensor  # [N] uint8 (what the kernels load: bool pointers they cannot mask with)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def bounds(self) -> list[int]:
        """cu_seqlens on the host, for the references' loop over requests."""
        return self.cu_seqlens.tolist()


_last: list = [None, None]  # [the key of the last batch checked, its Varlen]


def check_varlen(num_tokens: int, cu_seqlens: torch.Tensor, state_slots: torch.Tensor, num_slots: int,
                 has_initial_state: torch.Tensor | None, device: torch.device) -> Varlen:
    """Validate a varlen batch, naming the field at fault, and bring its index tensors to int64 on
    `device`. Two requests on one slot would race on its state, so slots must be distinct. The
    values are checked where they are on the host already: a GPU step must not wait on a copy back
    for each layer (the kernels mask nothing by slot, so a bad slot there is the caller's bug).
    A step passes the same tensors to every recurrent layer: the last batch's result is reused
    while they are the same objects, unmodified (their _version), about 30 us a call on CPU."""
    if any(t is not None and t.is_inference() for t in (cu_seqlens, state_slots, has_initial_state)):
        # made under inference_mode (a model's step): no version counter to tell an in-place change
        return _check_varlen(num_tokens, cu_seqlens, state_slots, num_slots, has_initial_state, device)
    key = (num_tokens, num_slots, device, cu_seqlens, cu_seqlens._version, state_slots, state_slots._version,
           has_initial_state, None if has_initial_state is None else has_initial_state._version)
    last_key, last = _last
    if last_key is not None and all(a is b or (type(a) is not torch.Tensor and a == b) for a, b in zip(key, last_key)):
        return last
    var = _check_varlen(num_tokens, cu_seqlens, state_slots, num_slots, has_initial_state, device)
    _last[:] = [key, var]  # holds the tensors: their ids cannot pass to new ones meanwhile
    return var


def _check_varlen(num_tokens, cu_seqlens, state_slots, num_slots, has_initial_state, device) -> Varlen:
    assert cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1, f"cu_seqlens: want [N + 1], got {tuple(cu_seqlens.shape)}"
    assert not cu_seqlens.dtype.is_floating_point, f"cu_seqlens: want an integer tensor, got {cu_seqlens.dtype}"
    n = cu_seqlens.numel() - 1
    assert state_slots.shape == (n,) and not state_slots.dtype.is_floating_point, \
        f"state_slots: want [{n}] integers, got {tuple(state_slots.shape)} {state_slots.dtype}"
    if not cu_seqlens.is_cuda:
        bounds = cu_seqlens.tolist()
        assert bounds[0] == 0 and bounds[-1] == num_tokens, f"cu_seqlens: must run from 0 to {num_tokens}, got {bounds}"
        assert all(a <= b for a, b in zip(bounds, bounds[1:])), f"cu_seqlens: must not decrease, got {bounds}"
    if not state_slots.is_cuda:
        slots = state_slots.tolist()
        assert all(0 <= s < num_slots for s in slots), f"state_slots: each in [0, {num_slots}), got {slots}"
        assert len(set(slots)) == n, f"state_slots: two requests share a slot: {slots}"
    if has_initial_state is None:
        has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
    assert has_initial_state.shape == (n,), f"has_initial_state: want [{n}], got {tuple(has_initial_state.shape)}"
    return Varlen(cu_seqlens.to(device=device, dtype=torch.int64).contiguous(),
                  state_slots.to(device=device, dtype=torch.int64).contiguous(),
                  has_initial_state.to(device=device, dtype=torch.uint8).contiguous())


def check_token_slots(token_state_slots: torch.Tensor | None, var: Varlen, num_tokens: int, num_slots: int,
                      device: torch.device) -> torch.Tensor | None:
    """token_state_slots [T]: where the state after each token is also written (-1: nowhere), so
    that speculative verification can roll a request back to the state after its last accepted
    token by copying one slot. None may be a request's own slot: the kernels run requests at once,
    and one request's kept state would overwrite another's while it is being read."""
    if token_state_slots is None:
        return None
    assert token_state_slots.shape == (num_tokens,) and not token_state_slots.dtype.is_floating_point, \
        f"token_state_slots: want [{num_tokens}] integers, got {tuple(token_state_slots.shape)}"
    if not token_state_slots.is_cuda:
        vals = token_state_slots.tolist()
        assert all(-1 <= s < num_slots for s in vals), f"token_state_slots: each in [-1, {num_slots}), got {vals}"
        kept = [s for s in vals if s >= 0]
        assert len(set(kept)) == len(kept), f"token_state_slots: a slot taken twice: {vals}"
        if not var.state_slots.is_cuda:
            shared = set(kept) & set(var.state_slots.tolist())
            assert not shared, f"token_state_slots: {sorted(shared)} also a request's state slot"
    return token_state_slots.to(device=device, dtype=torch.int64).contiguous()


def initial_state(state_pool: torch.Tensor, var: Varlen, n: int) -> torch.Tensor:
    """Request n's state in fp32, as the torch references start it: its slot's where it continues
    (has_initial_state), else zeros."""
    if bool(var.has_initial_state[n]):
        return state_pool[int(var.state_slots[n])].float()
    return torch.zeros(state_pool.shape[1:], dtype=torch.float32, device=state_pool.device)


def by_request(var: Varlen, state_pool: torch.Tensor, token_slots: torch.Tensor | None, run) -> None:
    """The torch references' token-by-token forms, a request at a time: run(a, b, initial, keep)
    runs tokens [a, b) from `initial` and returns the final state, which goes to the request's
    slot; keep(i, state) also writes the state after token a + i where token_slots names a slot."""
    bounds = var.bounds
    for n in range(var.num_seqs):
        a, b = bounds[n], bounds[n + 1]

        def keep(i, state, a=a):
            if token_slots is not None and int(token_slots[a + i]) >= 0:
                state_pool[int(token_slots[a + i])] = state.to(state_pool.dtype)

        state_pool[int(var.state_slots[n])] = run(a, b, initial_state(state_pool, var, n), keep).to(state_pool.dtype)

