"""The one plotting style of the runner's figures: a pyplot-free ``Figure`` (no GUI backend, no global
state; the way `runner.report` draws), saved at one resolution, and a 2-D view of vectors.

    fig, ax = new_figure((5.5, 5))
    (x2, c2), title = project_2d(x, centroids, fit=x, title="kmeans")
    ax.scatter(x2[:, 0], x2[:, 1])
    save_figure(fig, path, title)
"""

from __future__ import annotations

import numpy as np

__all__ = ["DPI", "category_colors", "new_figure", "project_2d", "save_figure"]

DPI = 110


def new_figure(figsize=(5.5, 5), nrows: int = 1, ncols: int = 1, squeeze: bool = True):
    """(figure, axes) of a fresh ``matplotlib.figure.Figure`` (``axes`` as ``plt.subplots`` gives them).
    Constrained layout: axes titles and the figure title make room for each other."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze)


def save_figure(fig, path, title: str | None = None) -> None:
    """Title (``suptitle``) and write ``path`` at :data:`DPI`."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=DPI)


def category_colors(labels) -> np.ndarray:
    """One RGB row per integer label, distinct for up to 20 categories: tab10's colours for up to 10,
    beyond that tab20's dark shades before its light ones (neighbouring labels never share a hue)."""
    from matplotlib import colormaps

    labels = np.asarray(labels)
    n = int(labels.max()) + 1 if labels.size else 0
    tab20 = colormaps["tab20"].colors
    palette = colormaps["tab10"].colors if n <= 10 else tab20[0::2] + tab20[1::2]
    return np.asarray(palette)[labels % len(palette)]


def project_2d(*arrays, fit=None, title: str = ""):
    """``arrays`` (each (n_i, d)) as 2-D points: unchanged when d = 2, else their PCA projection fitted
    on ``fit`` (default: all of them stacked), with " (PCA)" appended to ``title``.

    Returns (list of (n_i, 2) arrays, title).
    """
    if arrays[0].shape[1] == 2:
        return list(arrays), title
    from sklearn.decomposition import PCA

    pca = PCA(2).fit(np.vstack(arrays) if fit is None else fit)
    return [pca.transform(x) for x in arrays], title + " (PCA)"
