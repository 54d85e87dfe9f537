/* Exact minimiser of a grid MRF by dynamic programming over a raster-order frontier (`runner.methods.comixup`,
 * method "exact"). Compiled on first use by runner/methods/_native.py; called through ctypes.
 *
 *   E(l) = sum_k unary[k, l_k] + sum_{4-neighbour edges e = (k, k')} w_e pairwise[l_k, l_k']
 *
 * Label l is dropped at site k when unary[k, l] - min_l' unary[k, l'] > (sum of k's edge weights) * max(pairwise):
 * moving k to its cheapest label then lowers E whatever the neighbours are, so no minimiser has l at k (pairwise
 * >= 0). The DP state is the labels of the last g sites in raster order (the frontier), so site k sees its upper
 * neighbour (k - g, the oldest) and its left one (k - 1, the newest); one step adds site k and minimises out site
 * k - g. Ties go to the lower candidate index, so the result is deterministic.
 */
#include <math.h>
#include <stdlib.h>

static long frontier_count(const int *counts, int site) { return site < 0 ? 1 : counts[site]; }

/* One grid: grid x grid sites, `labels` labels; unary (n, labels) row-major, +inf forbidden; pairwise (labels,
 * labels); weights (2 g (g - 1)) in the order vertical edges row by row, then horizontal ones. Returns 0 and the
 * labels in out (n), or 1 when the DP would take more than max_work state updates (out untouched), or 2 when a
 * site has no finite label. */
static int solve_grid(int grid, int labels, const double *unary, const double *pairwise, const double *weights,
                      long max_work, int *out) {
    int n = grid * grid, vertical = grid * (grid - 1);
    double pmax = 0.0;
    for (int i = 0; i < labels * labels; i++) pmax = pairwise[i] > pmax ? pairwise[i] : pmax;
    int *cand = malloc(sizeof(int) * n * labels), *counts = malloc(sizeof(int) * n);
    int status = 0;
    for (int k = 0; k < n; k++) {
        int r = k / grid, c = k % grid;
        double reach = 0.0;  /* sum of k's edge weights */
        if (r > 0) reach += weights[(r - 1) * grid + c];
        if (r < grid - 1) reach += weights[r * grid + c];
        if (c > 0) reach += weights[vertical + r * (grid - 1) + c - 1];
        if (c < grid - 1) reach += weights[vertical + r * (grid - 1) + c];
        const double *u = unary + (long)k * labels;
        double lowest = INFINITY;
        for (int l = 0; l < labels; l++) lowest = u[l] < lowest ? u[l] : lowest;
        if (!isfinite(lowest)) { status = 2; break; }
        counts[k] = 0;
        for (int l = 0; l < labels; l++)
            if (isfinite(u[l]) && u[l] - lowest <= reach * pmax) cand[k * labels + counts[k]++] = l;
    }
    long work = 0, widest = 1, states = 1, stored = 0;
    for (int k = 0; k < n && status == 0; k++) {  /* the frontier's size after each step, and the work */
        work += states * counts[k];
        stored += states / frontier_count(counts, k - grid) * counts[k];
        states = states / frontier_count(counts, k - grid) * counts[k];
        widest = states > widest ? states : widest;
        if (work > max_work) status = 1;
    }
    if (status) { free(cand); free(counts); return status; }
    double *cost = malloc(sizeof(double) * widest), *next = malloc(sizeof(double) * widest);
    int *back = malloc(sizeof(int) * stored);  /* per step and new state: the candidate of the site minimised out */
    long *back_at = malloc(sizeof(long) * n), *rest_sizes = malloc(sizeof(long) * n);
    cost[0] = 0.0;
    states = 1;
    long offset = 0;
    for (int k = 0; k < n; k++) {
        int up = k - grid, left = k % grid ? k - 1 : -1, ck = counts[k];
        long c_up = frontier_count(counts, up), rest_size = states / c_up;
        double w_up = up >= 0 ? weights[up] : 0.0;  /* edge (up, k) is vertical edge up */
        double w_left = left >= 0 ? weights[vertical + (k / grid) * (grid - 1) + k % grid - 1] : 0.0;
        const double *u = unary + (long)k * labels;
        back_at[k] = offset;
        rest_sizes[k] = rest_size;
        for (long rest = 0; rest < rest_size; rest++) {
            const double *p_left = NULL;
            if (left >= 0) p_left = pairwise + (long)cand[left * labels + rest % counts[left]] * labels;
            for (int d = 0; d < ck; d++) {
                int l = cand[k * labels + d];
                const double *p_l = pairwise + (long)l * labels;
                double best = INFINITY;
                int arg = 0;
                for (long d_up = 0; d_up < c_up; d_up++) {
                    double v = cost[d_up * rest_size + rest];
                    if (up >= 0) v += w_up * p_l[cand[up * labels + d_up]];
                    if (v < best) { best = v; arg = (int)d_up; }
                }
                next[rest * ck + d] = best + u[l] + (p_left ? w_left * p_left[l] : 0.0);
                back[offset + rest * ck + d] = arg;
            }
        }
        offset += rest_size * ck;
        states = rest_size * ck;
        double *swap = cost; cost = next; next = swap;
    }
    long idx = 0;
    for (long i = 1; i < states; i++) if (cost[i] < cost[idx]) idx = i;
    for (int k = n - 1; k >= 0; k--) {  /* walk back: the state over sites k - g + 1 .. k -> over k - g .. k - 1 */
        long rest = idx / counts[k];
        out[k] = cand[k * labels + idx % counts[k]];
        idx = back[back_at[k] + idx] * rest_sizes[k] + rest;
    }
    free(cost); free(next); free(back); free(back_at); free(rest_sizes); free(cand); free(counts);
    return 0;
}

/* `grids` independent grids: unary (grids, n, labels), weights (grids, E), out (grids, n), status (grids). */
void grid_dp(int grids, int grid, int labels, const double *unary, const double *pairwise, const double *weights,
             long max_work, int *out, int *status) {
    int n = grid * grid, edges = 2 * grid * (grid - 1);
    for (int p = 0; p < grids; p++)
        status[p] = solve_grid(grid, labels, unary + (long)p * n * labels, pairwise, weights + (long)p * edges,
                               max_work, out + (long)p * n);
}
