"""The drafter's learning curve in the UI: each point the training job sends becomes an
observation of the asset as it arrives (real timestamps, watchable live)."""

import contextlib
import json
import logging

from dagster import AssetExecutionContext, AssetObservation, MetadataValue

from .entrypoints.train_drafter import CURVE_POINT


def curve_observation(asset_key, point: dict) -> AssetObservation:
    """One learning-curve point: loss and top-1 per TTT step as numbers (the UI plots them over
    the observations' times); its step and training time as text, which are not metrics."""
    return AssetObservation(asset_key=asset_key, description=f"step {point['step']}, {point['time_s']:.0f} s trained", metadata={
        "curve_step": MetadataValue.text(str(point["step"])),
        "curve_train_s": MetadataValue.text(f"{point['time_s']:.2f}"),
        "curve_loss": point["loss"],
        **{f"curve_top1_step_{k}": a for k, a in enumerate(point["accuracy"])},
    })


@contextlib.contextmanager
def observe_learning_curve(context: AssetExecutionContext):
    """While the training job runs, turn each learning-curve point it sends (a Pipes log line,
    `entrypoints/train_drafter.py` CURVE_POINT) into an observation of the asset, as it arrives."""

    class Points(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if not message.startswith(CURVE_POINT):
                return True
            context.log_event(curve_observation(context.asset_key, json.loads(message[len(CURVE_POINT):])))
            return False  # an observation, not a log line

    points = Points()
    context.log.addFilter(points)
    try:
        yield
    finally:
        context.log.removeFilter(points)
