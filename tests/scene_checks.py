"""Checks on images of a scene, for the converter tests."""

import numpy as np


def roughness(image: np.ndarray) -> float:
    """Mean absolute difference between 4-neighbours, over the mean over the last axis of
    ``image : (rows, cols[, d])``: small for a real scene, large for scrambled pixels (a
    reshape in the wrong order scrambles them)."""
    img = image.mean(axis=-1) if image.ndim == 3 else image
    return float(np.abs(np.diff(img, axis=0)).mean() + np.abs(np.diff(img, axis=1)).mean())
