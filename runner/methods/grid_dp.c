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
 * labels); weights (2 g (g - 1)) in the order vertical edges row by row, then horizontal ones, or one weight for
 * all edges (per_edge 0). Returns 0 and the labels in out (n), or 1 when the DP would take more than max_work
 * state updates (out untouched), or 2 when a site has no finite label. */
static int solve_grid(int grid, int labels, const double *unary, const double *pairwise, const double *edge_weights,
                      int per_edge, long max_work, int *out) {
    int edges = 2 * grid * (grid - 1);
    double *uniform = malloc(sizeof(double) * (edges > 0 ? edges : 1));
    for (int e = 0; e < edges && !per_edge; e++) uniform[e] = edge_weights[0];
    const double *weights = per_edge ? edge_weights : uniform;
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
    if (status) { free(cand); free(counts); free(uniform); return status; }
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
    free(cost); free(next); free(back); free(back_at); free(rest_sizes); free(cand); free(counts); free(uniform);
    return 0;
}

/* `grids` independent grids: unary (grids, n, labels), weights (grids, E) or one for all (per_edge 0), out
 * (grids, n), status (grids) as solve_grid's. */
void grid_dp(int grids, int grid, int labels, const double *unary, const double *pairwise, const double *weights,
             int per_edge, long max_work, int *out, int *status) {
    int n = grid * grid, edges = 2 * grid * (grid - 1);
    for (int p = 0; p < grids; p++)
        status[p] = solve_grid(grid, labels, unary + (long)p * n * labels, pairwise,
                               weights + (per_edge ? (long)p * edges : 0), per_edge, max_work, out + (long)p * n);
}

static const int BLEND_FIRST[3] = {0, 0, 1}, BLEND_SECOND[3] = {1, 2, 2}, PROTECTED_SLOTS[4] = {0, 0, 2, 3};

/* `_label_step` of runner/methods/comixup.py with method "exact", for `grids` partitions of m inputs: the same
 * slots (with `mixed`, inputs by decreasing count, stable, the blends of kept slots 0,1 / 0,2 / 1,2 after the
 * one-hot labels, a blend only of inputs in use), the same dominance rule (slot i goes when some i' has
 * U[i'] <= U[i] at every cell, ties to the lower slot, unless i is protected), the same costs, solved by
 * solve_grid with one weight beta_n. unary (grids, m, n) per input and cell, counts (grids, m); writes the
 * source weights W (grids, n, m) of the partitions with status 0 (status as solve_grid's). */
void label_step(int grids, int m, int grid, const double *unary, const double *counts, int mixed, double beta_n,
                double mix_bonus, long max_work, double *W, int *status) {
    int n = grid * grid;  /* on the heap: a large partition's label set would not fit the stack */
    int *order = malloc(sizeof(int) * m), *kept = malloc(sizeof(int) * m), *labels_out = malloc(sizeof(int) * n);
    int *pair_a = malloc(sizeof(int) * (m + 3)), *pair_b = malloc(sizeof(int) * (m + 3));
    double *costs = malloc(sizeof(double) * n * (m + 3)), *pairwise = malloc(sizeof(double) * (m + 3) * (m + 3));
    for (int p = 0; p < grids; p++) {
        const double *U = unary + (long)p * m * n, *count = counts + (long)p * m;
        int used = 0, protect = 0, k = 0;
        for (int i = 0; i < m; i++) order[i] = i;
        if (mixed) {
            for (int i = 1; i < m; i++)  /* insertion sort by decreasing count: stable */
                for (int j = i; j > 0 && count[order[j]] > count[order[j - 1]]; j--) {
                    int t = order[j]; order[j] = order[j - 1]; order[j - 1] = t;
                }
            for (int i = 0; i < m; i++) used += count[i] > 0;
            protect = PROTECTED_SLOTS[used < 3 ? used : 3];
        }
        for (int s = 0; s < m; s++) {
            int dominated = 0;
            const double *us = U + (long)order[s] * n;
            for (int t = 0; t < m && s >= protect && !dominated; t++) {
                if (t == s) continue;
                const double *ut = U + (long)order[t] * n;
                int geq = 1, leq = 1;  /* us >= ut, ut >= us at every cell */
                for (int c = 0; c < n; c++) { geq &= us[c] >= ut[c]; leq &= ut[c] >= us[c]; }
                dominated = geq && (!leq || s > t);
            }
            if (!dominated) kept[k++] = order[s];
        }
        int blends = mixed && k > 1 ? (k >= 3 ? 3 : 1) : 0, labels = k + blends;
        for (int l = 0; l < labels; l++) {  /* label l: inputs (a, b), one-hot where a == b */
            pair_a[l] = l < k ? kept[l] : kept[BLEND_FIRST[l - k]];
            pair_b[l] = l < k ? kept[l] : kept[BLEND_SECOND[l - k]];
        }
        for (int c = 0; c < n; c++)
            for (int l = 0; l < labels; l++) {
                double *cost = costs + c * labels + l;
                if (l < k) *cost = U[(long)kept[l] * n + c];
                else if (used > BLEND_SECOND[l - k])
                    *cost = 0.5 * (U[(long)pair_a[l] * n + c] + U[(long)pair_b[l] * n + c]) - mix_bonus;
                else *cost = INFINITY;
            }
        for (int l = 0; l < labels; l++)  /* 1/2 |v_l - v_l'|^2 of the label vectors */
            for (int l2 = 0; l2 < labels; l2++) {
                double v[4] = {0}, sq = 0.0;
                int at[4] = {pair_a[l], pair_b[l], pair_a[l2], pair_b[l2]};
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++)
                        if (at[j] == at[i]) v[i] += (j < 2 ? 0.5 : -0.5);
                for (int i = 0; i < 4; i++) {
                    int first = 1;  /* each input once */
                    for (int j = 0; j < i; j++) first &= at[j] != at[i];
                    if (first) sq += v[i] * v[i];
                }
                pairwise[l * labels + l2] = 0.5 * sq;
            }
        status[p] = solve_grid(grid, labels, costs, pairwise, &beta_n, 0, max_work, labels_out);
        if (status[p]) continue;
        double *w = W + (long)p * n * m;
        for (int i = 0; i < n * m; i++) w[i] = 0.0;
        for (int c = 0; c < n; c++) {
            w[c * m + pair_a[labels_out[c]]] += 0.5;
            w[c * m + pair_b[labels_out[c]]] += 0.5;
        }
    }
    free(order); free(kept); free(labels_out); free(pair_a); free(pair_b); free(costs); free(pairwise);
}
