"""Token pooling: fewer token vectors per document, as PyLate's `pool_factor` computes them.

Clark et al., "A Reproducibility Study of PLAID" / Answer.AI's token pooling (2024): a document's token vectors
are clustered hierarchically (Ward linkage on cosine distance, 1 - q·k of the normalized vectors) into
len // pool_factor clusters, each replaced by its mean; the first `protected` vectors ([CLS], the marker) are
kept as they are. Clustering is scipy's (`pip install 'polyvec[compression]'`), the same calls PyLate makes,
so a document gives the same clusters in the same order. Per document it calls the two compiled routines
behind `linkage` and `fcluster` directly: their Python-side checks cost more than the clustering of a
passage-sized document.
"""

from __future__ import annotations

import numpy as np
import torch

PROTECTED_TOKENS = 1  # PyLate's default: the [CLS] vector stays its own
MAX_POOL_BLOCK = 8192  # most vectors clustered together (n² distances): longer inputs pool in blocks


def ward_labels(distance: np.ndarray, clusters: int) -> np.ndarray:
    """scipy's `fcluster(linkage(condensed, "ward"), clusters, "maxclust")` for an [n, n] distance matrix:
    [n] labels from 1."""
    try:
        from scipy.cluster import hierarchy
        from scipy.spatial.distance import squareform
    except ImportError as e:  # an optional extra: the core install stays light
        raise ImportError("pool_factor needs scipy: pip install 'polyvec[compression]'") from e
    n = distance.shape[0]
    condensed = squareform(distance, checks=False).astype(np.float64)  # the upper triangle, row by row
    if not np.isfinite(condensed).all():
        raise ValueError("token vectors with NaN or infinite values cannot be pooled")
    try:  # the compiled routines linkage and fcluster end in, without their per-call checks
        from scipy.cluster import _hierarchy

        z = _hierarchy.nn_chain(condensed, n, hierarchy._LINKAGE_METHODS["ward"])
        labels = np.zeros(n, dtype=np.intc)
        _hierarchy.cluster_maxclust_dist(z, labels, n, clusters)
        return labels
    except (ImportError, AttributeError, KeyError, TypeError):  # another scipy's internals: the public calls
        return hierarchy.fcluster(hierarchy.linkage(condensed, method="ward"), t=clusters, criterion="maxclust")


def hierarchical_pool(vectors: torch.Tensor, pool_factor: int, protected: int = PROTECTED_TOKENS) -> torch.Tensor:
    """[n, d] token vectors → [protected + clusters, d]: the protected ones, then one mean per cluster (in
    scipy's cluster order). Unchanged when pooling would not reduce the count."""
    x = vectors.detach().to("cpu", torch.float32)
    kept, rest = x[:protected], x[protected:]
    n = rest.shape[0]
    clusters = max(n // pool_factor, 1)
    if clusters >= n:
        return vectors
    # [n, n]; at least 0: repeated vectors (a repeated passage's windows) are a rounding error below it
    distance = np.maximum(1 - torch.mm(rest, rest.t()).numpy(), 0)
    labels = torch.from_numpy(ward_labels(distance, clusters).astype(np.int64)) - 1
    sums = torch.zeros(clusters, rest.shape[1]).index_add_(0, labels, rest)  # [clusters, d]
    counts = torch.bincount(labels, minlength=clusters)
    used = counts > 0  # fcluster may form fewer clusters than asked
    pooled = sums[used] / counts[used].unsqueeze(1)
    return torch.cat([kept, pooled]).to(vectors.dtype)


def pool_in_blocks(vectors: torch.Tensor, pool_factor: int, block: int = MAX_POOL_BLOCK) -> torch.Tensor:
    """`hierarchical_pool` within consecutive blocks of at most `block` vectors (a window's worth: clustering
    costs n² memory and time, and a long input's windows joined ran to gigabytes), the first block's protected
    vectors kept; one block, as PyLate pools, for an input that fits."""
    block = min(block, MAX_POOL_BLOCK)
    if vectors.shape[0] <= block:
        return hierarchical_pool(vectors, pool_factor)
    parts = [hierarchical_pool(vectors[:block], pool_factor)]
    parts += [hierarchical_pool(vectors[i : i + block], pool_factor, 0) for i in range(block, vectors.shape[0], block)]
    return torch.cat(parts)
