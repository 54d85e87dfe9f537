/* Exact minimiser of one level of the hierarchical-hash code energy (`runner.methods.hier_hash`, method "ssp") by
 * successive shortest paths on the min-cost-flow network of Theorem 1. Compiled on first use by
 * runner/methods/_native.py; called through ctypes.
 *
 *   E(z) = - sum_p c_p . z_p + alpha sum_r sum_q y_rq (y_rq - 1) / 2 + beta sum_q y_q (y_q - 1) / 2,  |z_p|_1 = s
 *
 * Network: class p (supply s) -> bucket q (capacity 1, cost -c_p[q]), through the node (r, q) of p's sibling group
 * r when p has siblings, whose i-th unit into q costs i alpha; bucket q -> sink, the j-th unit costing j beta.
 * Each convex bundle of parallel arcs is one residual arc each way at its marginal cost: forward y alpha (y beta),
 * backward -(y - 1) alpha; the bundle's other arcs then have reduced costs no lower, so they need no node or arc.
 *
 * Invariant: every residual arc has a reduced cost c(u, v) + pi(u) - pi(v) >= 0, so the pseudoflow is optimal for
 * its excesses and any shortest path from a class with units left (excess) to the sink (the only node with a
 * deficit) keeps it so. One augmentation per unit, each found by Dijkstra from the sink over the residual arcs
 * reversed, stopped when a class with excess is scanned at distance D; then pi(v) += D - dist(v) on the scanned
 * nodes (reduced costs stay >= 0, the path's become 0) and the unit moves along the path. Searching backward finds
 * the cheapest path of any class with excess: when the classes are alike (a shared preference, a spread below
 * beta) this leaves out the long chains of swaps that a fixed class order forces on a search from each class
 * (6.3 -> 1.9 ms a cascade at d = 128, ks = 4). Start: pi(p) = max_q c_p[q], pi(q) = min_p (pi(p) - c_p[q]) >= 0
 * (the least reduced cost into q, so the search meets first the buckets some class wants), pi(sink) = 0.
 * Not done: several paths a Dijkstra (primal-dual): with float unaries two paths rarely cost the same, so the
 * admissible graph of a run holds one path.
 *
 * A group node (r, q) exists while some class of r is in q. Empty, it is a pass-through of cost 0 whose potential
 * cancels, so class p reaches bucket q directly; when its first class arrives it takes q's potential, which keeps
 * the reduced costs of its arcs >= 0. The loads are counts of z: y_q the classes in q, y_rq those of group r.
 * Costs are float64; each reduced cost is recomputed from the costs and the potentials, so no error accumulates
 * along a path beyond the potentials' own rounding.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double key;
    int node;
} Entry;

typedef struct {
    Entry *items;
    int size;
} Heap;

static void heap_push(Heap *h, double key, int node) {
    int i = h->size++;
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (h->items[parent].key <= key) break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i].key = key;
    h->items[i].node = node;
}

/* Put `item` at place i or below it, moving smaller children up. */
static void sift_down(Heap *h, int i, Entry item) {
    for (;;) {
        int child = 2 * i + 1;
        if (child >= h->size) break;
        if (child + 1 < h->size && h->items[child + 1].key < h->items[child].key) child++;
        if (item.key <= h->items[child].key) break;
        h->items[i] = h->items[child];
        i = child;
    }
    h->items[i] = item;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->items[0];
    if (--h->size > 0) sift_down(h, 0, h->items[h->size]);
    return top;
}

typedef struct {
    int nc, d, s, sink;
    const double *unary, *unary_t; /* (nc, d) and its transpose (d, nc) */
    const int *group, *group_start, *group_members; /* a class's sibling group; each group's classes (CSR) */
    double alpha, beta;
    unsigned char *z;
    int *members, *n_members, *slot; /* classes per bucket (d x nc), their count, a class's place in its list */
    int *held, *n_held;              /* the buckets a class is in (nc x s), their count */
    int *group_load;                 /* y_rq, (n_groups x d) */
    int *excess;                     /* units a class has still to send */
    double *pi, *dist;
    int *next, *reached, *scanned, round;
    double bound; /* the best tentative distance of a class with excess: no node at or beyond it is scanned first */
    Heap heap;
} Flow;

static int group_node(const Flow *f, int r, int q) { return f->sink + 1 + r * f->d + q; }

/* The bucket of a bucket node or of a group node. */
static int bucket_of(const Flow *f, int node) { return node < f->sink ? node - f->nc : (node - f->sink - 1) % f->d; }

/* Arc (to, from) of reduced cost `distance - at(from)` gives `to` the distance `distance` to the sink. A node at or
 * beyond the nearest class with excess (`bound`) is never scanned before it, so it stays out of the heap. */
static void relax(Flow *f, int from, int to, double distance) {
    if (distance >= f->bound) return;
    if (f->scanned[to] == f->round || (f->reached[to] == f->round && distance >= f->dist[to])) return;
    f->reached[to] = f->round;
    f->dist[to] = distance;
    f->next[to] = from;
    heap_push(&f->heap, distance, to);
    if (to < f->nc && f->excess[to] > 0) f->bound = distance;
}

/* Relax the residual arcs into v, which is at distance `at` from the sink. */
static void scan(Flow *f, int v, double at) {
    int nc = f->nc, d = f->d;
    const double *pi = f->pi;
    if (v < nc) { /* class p: back out of each bucket it is in (through its group's node there) */
        int p = v, r = f->group[p];
        for (int i = 0; i < f->n_held[p]; i++) {
            int q = f->held[p * f->s + i], u = r >= 0 ? group_node(f, r, q) : nc + q;
            relax(f, v, u, at + f->unary[(long)p * d + q] + pi[u] - pi[p]);
        }
    } else if (v < f->sink) { /* bucket q: a class not in it enters directly, a group node in use forwards */
        int q = v - nc;
        const double *c = f->unary_t + (long)q * nc;
        double from = at - pi[v];
        for (int p = 0; p < nc; p++) {
            if (f->z[(long)p * d + q]) continue;
            int r = f->group[p];
            if (r >= 0 && f->group_load[r * d + q]) continue; /* it enters through its group's node */
            double distance = from - c[p] + pi[p];
            if (distance < f->bound) relax(f, v, p, distance);
        }
        for (int i = 0; i < f->n_members[q]; i++) {
            int r = f->group[f->members[q * nc + i]], u = r >= 0 ? group_node(f, r, q) : -1;
            if (r >= 0) relax(f, v, u, from + f->group_load[r * d + q] * f->alpha + pi[u]);
        }
    } else { /* group node (r, q) in use: a class of r not in q enters it, or bucket q sends a unit back */
        int r = (v - f->sink - 1) / d, q = bucket_of(f, v);
        for (int i = f->group_start[r]; i < f->group_start[r + 1]; i++) {
            int p = f->group_members[i];
            if (!f->z[(long)p * d + q]) relax(f, v, p, at - f->unary[(long)p * d + q] + pi[p] - pi[v]);
        }
        relax(f, v, nc + q, at - (f->group_load[r * d + q] - 1) * f->alpha + pi[nc + q] - pi[v]);
    }
}

static void enter(Flow *f, int p, int q) {
    f->z[(long)p * f->d + q] = 1;
    f->slot[(long)p * f->d + q] = f->n_members[q];
    f->members[q * f->nc + f->n_members[q]++] = p;
    f->held[p * f->s + f->n_held[p]++] = q;
    int r = f->group[p];
    if (r >= 0 && f->group_load[r * f->d + q]++ == 0) f->pi[group_node(f, r, q)] = f->pi[f->nc + q];
}

static void leave(Flow *f, int p, int q) {
    f->z[(long)p * f->d + q] = 0;
    int i = f->slot[(long)p * f->d + q], last = f->members[q * f->nc + --f->n_members[q]];
    f->members[q * f->nc + i] = last;
    f->slot[(long)last * f->d + q] = i;
    int *held = f->held + p * f->s, j = 0;
    while (held[j] != q) j++;
    held[j] = held[--f->n_held[p]];
    if (f->group[p] >= 0) f->group_load[f->group[p] * f->d + q]--;
}

/* One level: unary (nc, d) row-major; group (nc) the class's sibling group in [0, n_groups), or -1 for a class
 * without siblings; s units per class, 1 <= s <= d. Writes z (nc, d) of 0/1 and the flow's cost (the sum of the
 * augmenting paths' costs, = E(z)); returns the nodes scanned over all Dijkstra runs, or -1 when out of memory. */
long hash_flow(int nc, int d, int s, const double *unary, const int *group, int n_groups, double alpha, double beta,
               unsigned char *z, double *flow_cost) {
    int n_nodes = nc + d + 1 + n_groups * d;
    /* each arc is relaxed at most once per run: into the sink, the buckets, the group nodes, the classes */
    long n_arcs = d + (long)nc * d + 2L * n_groups * d + (long)nc * s + 2;
    Flow f = {nc, d, s, nc + d, unary, NULL, group, NULL, NULL, alpha, beta, z};
    double *unary_t = malloc(sizeof(double) * (size_t)nc * d);
    f.unary_t = unary_t;
    int *group_start = calloc((size_t)n_groups + 2, sizeof(int)), *group_members = malloc(sizeof(int) * nc);
    f.group_start = group_start, f.group_members = group_members;
    f.members = malloc(sizeof(int) * (size_t)nc * d);
    f.n_members = calloc(d, sizeof(int));
    f.slot = malloc(sizeof(int) * (size_t)nc * d);
    f.held = malloc(sizeof(int) * (size_t)nc * s);
    f.n_held = calloc(nc, sizeof(int));
    f.group_load = calloc((size_t)n_groups * d + 1, sizeof(int));
    f.excess = malloc(sizeof(int) * nc);
    f.pi = calloc(n_nodes, sizeof(double));
    f.dist = malloc(sizeof(double) * n_nodes);
    f.next = malloc(sizeof(int) * n_nodes);
    f.reached = calloc(n_nodes, sizeof(int));
    f.scanned = calloc(n_nodes, sizeof(int));
    f.heap.items = malloc(sizeof(Entry) * n_arcs);
    int *order = malloc(sizeof(int) * n_nodes); /* the nodes scanned in this run */
    long total_scanned = -1;
    if (!unary_t || !group_start || !group_members || !f.members || !f.n_members || !f.slot || !f.held ||
        !f.n_held || !f.group_load || !f.excess || !f.pi || !f.dist || !f.next || !f.reached || !f.scanned ||
        !f.heap.items || !order)
        goto done;
    memset(z, 0, (size_t)nc * d);
    for (int p = 0; p < nc; p++) {
        double best = unary[(long)p * d];
        for (int q = 0; q < d; q++) {
            unary_t[(long)q * nc + p] = unary[(long)p * d + q];
            best = unary[(long)p * d + q] > best ? unary[(long)p * d + q] : best;
        }
        f.pi[p] = best;
        f.excess[p] = s;
        if (group[p] >= 0) group_start[group[p] + 2]++;
    }
    for (int q = 0; q < d; q++) { /* pi(q) = the least reduced cost of a class into q: its in-arcs keep >= 0 */
        double least = INFINITY;
        for (int p = 0; p < nc; p++) least = fmin(least, f.pi[p] - unary_t[(long)q * nc + p]);
        f.pi[nc + q] = least;
    }
    for (int r = 0; r < n_groups; r++) group_start[r + 2] += group_start[r + 1];
    for (int p = 0; p < nc; p++)
        if (group[p] >= 0) group_members[group_start[group[p] + 1]++] = p;
    *flow_cost = 0.0;
    total_scanned = 0;
    for (long unit = 0; unit < (long)nc * s; unit++) {
        f.round++;
        f.heap.size = 0;
        f.bound = INFINITY;
        int n_scanned = 0, source = -1;
        /* the sink is scanned first: its d in-arcs go into the heap at once (heapified, not pushed one by one) */
        f.scanned[f.sink] = f.round;
        f.dist[f.sink] = 0.0;
        order[n_scanned++] = f.sink;
        for (int q = 0; q < d; q++) {
            int v = nc + q;
            f.reached[v] = f.round;
            f.dist[v] = f.n_members[q] * beta + f.pi[v] - f.pi[f.sink];
            f.next[v] = f.sink;
            f.heap.items[q] = (Entry){f.dist[v], v};
        }
        f.heap.size = d;
        for (int i = d / 2 - 1; i >= 0; i--) sift_down(&f.heap, i, f.heap.items[i]);
        while (f.heap.size > 0) { /* a class with excess is always reached: s <= d */
            Entry top = heap_pop(&f.heap);
            if (f.scanned[top.node] == f.round) continue;
            f.scanned[top.node] = f.round;
            order[n_scanned++] = top.node;
            if (top.node < nc && f.excess[top.node] > 0) {
                source = top.node;
                break;
            }
            scan(&f, top.node, top.key);
        }
        double reach = f.dist[source];
        *flow_cost += reach - f.pi[source] + f.pi[f.sink]; /* the path's cost: reduced costs telescope */
        for (int i = 0; i < n_scanned; i++) f.pi[order[i]] += reach - f.dist[order[i]];
        /* the path, source first: a class enters a group node before another leaves it, so a node that stays
         * in use never looks new (and has its potential reset) halfway; only arcs at classes change z */
        for (int u = source, v; u != f.sink; u = v) {
            v = f.next[u];
            if (u < nc) enter(&f, u, bucket_of(&f, v));
            else if (v < nc) leave(&f, v, bucket_of(&f, u));
        }
        f.excess[source]--;
        total_scanned += n_scanned;
    }
done:
    free(unary_t), free(group_start), free(group_members), free(f.members), free(f.n_members), free(f.slot);
    free(f.held), free(f.n_held), free(f.group_load), free(f.excess), free(f.pi), free(f.dist), free(f.next);
    free(f.reached), free(f.scanned), free(f.heap.items), free(order);
    return total_scanned;
}
