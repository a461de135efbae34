"""What `tf_adasum.AdasumDiagnostics` must report, computed in numpy from the replicas' deltas."""

import numpy as np

from tf_adasum import reference


def tree_levels(values):
    """The pairs the Adasum tree combines, level by level (the fold first)."""
    leaves, folded = reference.tree_shape(len(values))
    levels = []
    if folded:
        levels.append([(values[2 * i], values[2 * i + 1]) for i in range(folded)])
        current = [reference.adasum_pair(a, b) for a, b in levels[-1]] + values[2 * folded :]
    else:
        current = list(values)
    while len(current) > 1:
        levels.append([(current[2 * i], current[2 * i + 1]) for i in range(len(current) // 2)])
        current = [reference.adasum_pair(a, b) for a, b in levels[-1]]
    return levels


def expected_statistics(deltas):
    """Statistics of one tensor, given each replica's delta (float64)."""
    norms = [np.linalg.norm(d) for d in deltas]
    combined = reference.tree_reduce(deltas, reference.adasum_pair)
    stats = {
        "delta_norm_min": min(norms),
        "delta_norm_mean": np.mean(norms),
        "delta_norm_max": max(norms),
        "combined_norm": np.linalg.norm(combined),
        "orthogonality": np.sum(combined**2) / np.sum([n**2 for n in norms]),
        "delta_sq_sum": np.sum([n**2 for n in norms]),
    }
    for k, pairs in enumerate(tree_levels(deltas)):
        quantities = {"cos": [], "coef_a": [], "coef_b": []}
        for a, b in pairs:
            dot, a_sq, b_sq = np.sum(a * b), np.sum(a * a), np.sum(b * b)
            quantities["cos"].append(dot / np.sqrt(a_sq * b_sq))
            c_a, c_b = reference.adasum_coefficients(dot, a_sq, b_sq)
            quantities["coef_a"].append(c_a)
            quantities["coef_b"].append(c_b)
        for name, values in quantities.items():
            stats[f"level{k}/{name}_min"] = min(values)
            stats[f"level{k}/{name}_mean"] = np.mean(values)
            stats[f"level{k}/{name}_max"] = max(values)
    return stats


def assert_statistics_equal(got: dict, expected: dict, where: str = "") -> None:
    """Equal to float32 precision: the recorded deltas are float32, the expected
    ones float64, so cosines and coefficients (of order 1, and a cosine near 0
    is a difference of nearly equal products) are compared to 1e-5 absolute."""
    assert set(got) == set(expected), (where, sorted(set(got) ^ set(expected)))
    for key, value in expected.items():
        atol = 1e-5 if "/" in key else 1e-7
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=atol, err_msg=f"{where} {key}")
