"""torchair.ops: graph-friendly ops.

- npu_print: prints tensors (TorchAir's format: summarize_size elements per end of each dim,
  optionally shape and dtype) without breaking the graph: under torch.compile Dynamo keeps it out
  of the graph and calls it after the graph ran, with the values the tensors had, in program
  order (torch._dynamo.config.reorderable_logging_functions). In eager mode it prints at once.
- record / wait: TorchAir's cross-stream ordering points. One stream runs here, so record()
  returns an empty tensor (as TorchAir's does) and wait() only checks its argument.
- npu_create_tagged_event / npu_tagged_event_record / npu_tagged_event_wait: a torch.npu.Event
  per tag, recorded and waited on as events are. npu_record_tagged_stream (memory reuse across
  tagged streams) is an accepted no-op.
- npu_fused_infer_attention_score(_v2): opennpu has no kernel for these ops yet; calling them
  raises NotImplementedError naming the op.
"""

from __future__ import annotations

import torch


def _format(t: torch.Tensor, summarize_size: int, detail: bool) -> str:
    edge = t.numel() if summarize_size < 0 else summarize_size
    with torch._tensor_str.printoptions(threshold=0 if summarize_size >= 0 else float("inf"),
                                        edgeitems=max(edge, 1)):
        text = repr(t.detach().cpu())
    if detail:
        text = f"{text[:-1] if text.endswith(')') else text}, shape={list(t.shape)}, dtype={t.dtype})"
    return text


def npu_print(*args, summarize_size: int = 3, tensor_detail: bool = False) -> None:
    if not any(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("npu_print: at least one argument must be a Tensor, got "
                        f"{[type(a).__name__ for a in args]}")
    if isinstance(summarize_size, bool) or not isinstance(summarize_size, int) or (
            summarize_size < 1 and summarize_size != -1):
        raise ValueError(f"npu_print: summarize_size must be -1 (all elements) or a positive int, "
                         f"got {summarize_size!r}")
    print(" ".join(_format(a, summarize_size, tensor_detail) if isinstance(a, torch.Tensor)
                   else str(a) for a in args))


def _register_reorderable() -> None:
    import torch._dynamo.config as dynamo_config

    dynamo_config.reorderable_logging_functions.add(npu_print)


_register_reorderable()


def record() -> torch.Tensor:
    return torch.empty(0)


def wait(tensors: list) -> None:
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor)
                                                         for t in tensors):
        raise TypeError(f"wait: tensors must be a list of Tensors, got {tensors!r}")


_tagged_events: dict[str, object] = {}


def npu_create_tagged_event(tag: str):
    if not isinstance(tag, str):
        raise TypeError(f"npu_create_tagged_event: tag must be str, got {type(tag).__name__}")
    if tag not in _tagged_events:
        _tagged_events[tag] = torch.npu.Event()
    return _tagged_events[tag]


def npu_tagged_event_record(event) -> None:
    event.record()


def npu_tagged_event_wait(event) -> None:
    event.wait()


def npu_record_tagged_stream(input: torch.Tensor, tagged_stream: str) -> None:  # noqa: A002
    if not isinstance(input, torch.Tensor) or not isinstance(tagged_stream, str):
        raise TypeError(f"npu_record_tagged_stream: expected (Tensor, str), got "
                        f"({type(input).__name__}, {type(tagged_stream).__name__})")


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"torchair.ops.{name}: opennpu has no kernel for this op yet "
                                  f"(neither does torch_npu.{name} here)")

    op.__name__ = name
    return op


npu_fused_infer_attention_score = _missing("npu_fused_infer_attention_score")
npu_fused_infer_attention_score_v2 = _missing("npu_fused_infer_attention_score_v2")
