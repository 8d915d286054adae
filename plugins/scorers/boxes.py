"""Grounding: the IoU of the answer's boxes with the reference's, correct at IoU >= 0.5 (RefCOCO's accuracy).

A box is four numbers in brackets, ``[x1, y1, x2, y2]`` (Qwen2.5-VL's and Qwen3-VL's ``"bbox_2d"``, LLaVA's
fractions), or two corners, ``(x1,y1),(x2,y2)`` (Qwen2-VL's ``<|box_start|>`` form, whose markers decoding
drops). The boxes are in the model family's coordinate convention (``ModelFamily.box_coordinates``,
``context["box_coordinates"]``): ``absolute`` pixels of the resized image, ``relative-1000`` or ``relative-1``
(fractions). vlft never converts between them: a reference box outside its convention's range is an error
(a set written for another family), and the answer's coordinates are clamped to that range. IoU itself does not
change when both boxes are scaled alike, so the convention decides what is valid, not the figure.

Each reference box is paired with the answer's box in the same place (the first with the first); a missing
one scores 0. An answer's value (the reward) is the mean IoU over its reference's boxes. Figures: ``iou`` (the
mean over answers) and ``iou_accuracy`` (the share of reference boxes with IoU >= 0.5).
"""

from __future__ import annotations

import re

from vlft import Scorer

NUM = r"[-+]?\d+(?:\.\d+)?"
BOX = re.compile(
    rf"\[\s*({NUM})\s*,\s*({NUM})\s*,\s*({NUM})\s*,\s*({NUM})\s*\]"
    rf"|\(\s*({NUM})\s*,\s*({NUM})\s*\)\s*,?\s*\(\s*({NUM})\s*,\s*({NUM})\s*\)"
)
RANGES = {"absolute": (0.0, float("inf")), "relative-1000": (0.0, 1000.0), "relative-1": (0.0, 1.0)}
CORRECT_AT = 0.5

Box = tuple[float, float, float, float]


def boxes_in(text: str) -> list[Box]:
    """Every box written in ``text``, in order."""
    out = []
    for m in BOX.finditer(text):
        x1, y1, x2, y2 = (float(v) for v in (m.groups()[:4] if m.group(1) is not None else m.groups()[4:]))
        out.append((x1, y1, x2, y2))
    return out


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes (corners in any order)."""
    ax1, ax2, ay1, ay2 = min(a[0], a[2]), max(a[0], a[2]), min(a[1], a[3]), max(a[1], a[3])
    bx1, bx2, by1, by2 = min(b[0], b[2]), max(b[0], b[2]), min(b[1], b[3]), max(b[1], b[3])
    w, h = min(ax2, bx2) - max(ax1, bx1), min(ay2, by2) - max(ay1, by1)
    inter = max(0.0, w) * max(0.0, h)
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union if union > 0 else 0.0


def _range(context) -> tuple[str | None, tuple[float, float]]:
    convention = context.get("box_coordinates")
    return convention, RANGES.get(convention, (float("-inf"), float("inf")))


def reference_boxes(reference: str, context) -> list[Box]:
    convention, (low, high) = _range(context)
    found = boxes_in(reference)
    if not found:
        raise ValueError(f"the reference {reference!r} holds no box ([x1, y1, x2, y2] or (x1,y1),(x2,y2))")
    for box in found:
        if not all(low <= v <= high for v in box):
            raise ValueError(
                f"the reference box {list(box)} is outside the {convention} range of the model "
                f"family ({low:g} to {high:g}); vlft never converts boxes: write them in the "
                f"family's convention"
            )
    return found


def clamp(box: Box, context) -> Box:
    _, (low, high) = _range(context)
    return tuple(min(max(v, low), high) for v in box)  # type: ignore[return-value]


def pairs(predictions, references, context) -> list[list[float]]:
    """Each answer's IoU per reference box."""
    out = []
    for prediction, reference in zip(predictions, references):
        wanted = reference_boxes(reference, context)
        got = [clamp(b, context) for b in boxes_in(prediction)]
        out.append([iou(w, got[i]) if i < len(got) else 0.0 for i, w in enumerate(wanted)])
    return out


def iou_score(predictions, references, **context):
    return [sum(each) / len(each) for each in pairs(predictions, references, context)]


def iou_figures(predictions, references, values, **context):
    every = [v for each in pairs(predictions, references, context) for v in each]
    return {
        "iou": sum(values) / len(values) if values else 0.0,
        "iou_accuracy": sum(v >= CORRECT_AT for v in every) / len(every) if every else 0.0,
    }


def iou_fit(references, **context):
    convention, (low, high) = _range(context)
    for reference in references:
        found = boxes_in(reference)
        if not found or not all(low <= v <= high for box in found for v in box):
            return ""
    where = f" ({convention}, the family's convention)" if convention else ""
    return f"every reference holds a box{where}"


SCORERS = [
    Scorer(
        "iou",
        "grounding: IoU of the answer's box with the reference's, correct at >= 0.5, in the family's "
        "coordinate convention",
        iou_score,
        iou_figures,
        iou_fit,
    ),
]
