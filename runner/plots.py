"""The one plotting style of the runner's figures: a pyplot-free ``Figure`` (no GUI backend, no global
state; the way `runner.report` draws), saved at one resolution, and a 2-D view of vectors.

    fig, ax = new_figure((5.5, 5))
    (x2, c2), title = project_2d(x, centroids, fit=x, title="kmeans")
    ax.scatter(x2[:, 0], x2[:, 1])
    save_figure(fig, path, title)
"""

from __future__ import annotations

import numpy as np

__all__ = ["DPI", "new_figure", "project_2d", "save_figure"]

DPI = 110


def new_figure(figsize=(5.5, 5), nrows: int = 1, ncols: int = 1, squeeze: bool = True):
    """(figure, axes) of a fresh ``matplotlib.figure.Figure`` (``axes`` as ``plt.subplots`` gives them)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, squeeze=squeeze)


def save_figure(fig, path, title: str | None = None) -> None:
    """Title (``suptitle``), tight layout, write ``path`` at :data:`DPI`."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


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
