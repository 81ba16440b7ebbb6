"""The figures a study hands to save_figure, kept open for a test to inspect
(each still written to its path)."""
from __future__ import annotations


def capture_figures(monkeypatch, dpi: int = 50) -> list:
    import testbed.experiments as E
    figs = []

    def keep(fig, path, title=None):
        figs.append(fig)
        fig.savefig(path, dpi=dpi)
        return path
    monkeypatch.setattr(E, "save_figure", keep)
    return figs
