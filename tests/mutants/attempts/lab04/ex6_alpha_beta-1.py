# origin: considered alternative
# what I believed: relative least squares = weighted least squares with weights 1/t**2 (the usual 1/sigma**2, sigma
#   proportional to t), so I multiplied each row of the system (and the target) by 1/t**2.
# visible check said: AssertionError: (0.0003559, 4.117e-10) is not where the sum of squared relative errors over N = 2, 3, 4 is smallest
# grader said: 0/3  AssertionError: (0.0003559, 4.117e-10) is not where the sum of squared relative errors over N = 2... (check line 24)
# misconception: the weight 1/t**2 belongs on the SQUARED residual; in lstsq the rows themselves are scaled by 1/t
#   (as np.polyfit's w=1/t); scaling the rows by 1/t**2 minimises sum((model - t)/t**2)**2 and over-weights the
#   fastest measurements.
def fit_ring(nbytes, ranks, seconds):
    S = np.asarray(nbytes, dtype=np.float64)
    N = np.asarray(ranks, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    # weighted least squares, weights 1/t**2 on each row (relative errors)
    w = 1 / t**2
    A = np.stack([(N - 1) * w, 2 * (N - 1) / N * S * w], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    return float(alpha), float(beta)

def crossover_ranks(nbytes, ring_fit, ps_fit, max_ranks=1024):
    (a_ring, b_ring), (a_ps, b_ps) = ring_fit, ps_fit
    for n in range(2, max_ranks + 1):
        t_ring = (n - 1) * a_ring + 2 * (n - 1) / n * nbytes * b_ring
        t_ps = a_ps + (n - 1) * nbytes * b_ps
        if t_ps > t_ring:
            return n
    return None
