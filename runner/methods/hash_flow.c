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
 * One augmentation per unit of class supply, classes in order: Dijkstra from the class on the reduced costs
 * c(u, v) + pi(u) - pi(v) >= 0, stopped when the sink is scanned at distance D; then pi(v) += dist(v) - D on the
 * scanned nodes (reduced costs stay >= 0, the path's become 0) and the unit moves along the path. The sink is
 * the only node with a deficit, so no arc out of it is ever needed. Start: pi(p) = max_q c_p[q], 0 elsewhere.
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

static Entry heap_pop(Heap *h) {
    Entry top = h->items[0], last = h->items[--h->size];
    int i = 0;
    for (;;) {
        int child = 2 * i + 1;
        if (child >= h->size) break;
        if (child + 1 < h->size && h->items[child + 1].key < h->items[child].key) child++;
        if (last.key <= h->items[child].key) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->size > 0) h->items[i] = last;
    return top;
}

typedef struct {
    int nc, d, sink;
    const double *unary;
    const int *group;
    double alpha, beta;
    unsigned char *z;
    int *members, *n_members, *slot; /* classes per bucket (d x nc), their count, a class's place in its list */
    int *group_load;                 /* y_rq, (n_groups x d) */
    double *pi, *dist;
    int *pred, *reached, *scanned, round;
    double bound; /* the sink's tentative distance in this run: no node at or beyond it is scanned first */
    Heap heap;
} Flow;

static int group_node(const Flow *f, int r, int q) { return f->sink + 1 + r * f->d + q; }

/* The bucket of a bucket node or of a group node. */
static int bucket_of(const Flow *f, int node) { return node < f->sink ? node - f->nc : (node - f->sink - 1) % f->d; }

static int improves(const Flow *f, int node, double distance) {
    return f->scanned[node] != f->round && (f->reached[node] != f->round || distance < f->dist[node]);
}

static void label(Flow *f, int from, int to, double distance) {
    if (to == f->sink) f->bound = distance;
    f->reached[to] = f->round;
    f->dist[to] = distance;
    f->pred[to] = from;
    heap_push(&f->heap, distance, to);
}

/* Relax arc (from, to). A node at or beyond the sink's tentative distance (`bound`) is never scanned before the
 * sink, so it stays out of the heap; a bucket's arc to the sink is relaxed as soon as the bucket is reached (rather
 * than when it is scanned, which it still is first: that arc's reduced cost is >= 0), so the bound tightens early. */
static void relax(Flow *f, int from, int to, double distance) {
    if (distance >= f->bound || !improves(f, to, distance)) return;
    label(f, from, to, distance);
    if (to >= f->nc && to < f->sink) {
        double through = distance + f->n_members[to - f->nc] * f->beta + f->pi[to] - f->pi[f->sink];
        if (improves(f, f->sink, through)) label(f, to, f->sink, through);
    }
}

static void scan(Flow *f, int u, double at) {
    int nc = f->nc, d = f->d;
    if (u < nc) { /* class: forward to every bucket it is not in, through its group's node there if it is used */
        const double *c = f->unary + (long)u * d;
        const unsigned char *in = f->z + (long)u * d;
        int r = f->group[u];
        const int *group_load = r >= 0 ? f->group_load + r * d : NULL;
        int group_nodes = r >= 0 ? group_node(f, r, 0) : 0;
        double from = at + f->pi[u];
        for (int q = 0; q < d; q++) {
            if (in[q]) continue;
            int v = group_load && group_load[q] ? group_nodes + q : nc + q;
            double distance = from - c[q] - f->pi[v];
            if (distance < f->bound) relax(f, u, v, distance);
        }
    } else if (u < f->sink) { /* bucket: back out of it through a class in it (its sink arc is relaxed) */
        int q = u - nc;
        for (int i = 0; i < f->n_members[q]; i++) {
            int p = f->members[q * nc + i], r = f->group[p];
            if (r < 0) {
                relax(f, u, p, at + f->unary[(long)p * d + q] + f->pi[u] - f->pi[p]);
            } else {
                int v = group_node(f, r, q);
                relax(f, u, v, at - (f->group_load[r * d + q] - 1) * f->alpha + f->pi[u] - f->pi[v]);
            }
        }
    } else { /* group node (r, q): on into bucket q, or back out through a class of r in q */
        int r = (u - f->sink - 1) / d, q = bucket_of(f, u);
        relax(f, u, nc + q, at + f->group_load[r * d + q] * f->alpha + f->pi[u] - f->pi[nc + q]);
        for (int i = 0; i < f->n_members[q]; i++) {
            int p = f->members[q * nc + i];
            if (f->group[p] == r) relax(f, u, p, at + f->unary[(long)p * d + q] + f->pi[u] - f->pi[p]);
        }
    }
}

static void enter(Flow *f, int p, int q) {
    f->z[(long)p * f->d + q] = 1;
    f->slot[(long)p * f->d + q] = f->n_members[q];
    f->members[q * f->nc + f->n_members[q]++] = p;
    int r = f->group[p];
    if (r >= 0 && f->group_load[r * f->d + q]++ == 0) f->pi[group_node(f, r, q)] = f->pi[f->nc + q];
}

static void leave(Flow *f, int p, int q) {
    f->z[(long)p * f->d + q] = 0;
    int i = f->slot[(long)p * f->d + q], last = f->members[q * f->nc + --f->n_members[q]];
    f->members[q * f->nc + i] = last;
    f->slot[(long)last * f->d + q] = i;
    if (f->group[p] >= 0) f->group_load[f->group[p] * f->d + q]--;
}

/* One level: unary (nc, d) row-major; group (nc) the class's sibling group in [0, n_groups), or -1 for a class
 * without siblings; s units per class, 1 <= s <= d. Writes z (nc, d) of 0/1 and the flow's cost (the sum of the
 * augmenting paths' costs, = E(z)); returns the nodes scanned over all Dijkstra runs, or -1 when out of memory. */
long hash_flow(int nc, int d, int s, const double *unary, const int *group, int n_groups, double alpha, double beta,
               unsigned char *z, double *flow_cost) {
    int n_nodes = nc + d + 1 + n_groups * d;
    long n_arcs = (long)nc * d + d + 3L * nc * s + 1; /* each arc is relaxed at most once per run */
    Flow f = {nc, d, nc + d, unary, group, alpha, beta, z};
    f.members = malloc(sizeof(int) * (size_t)nc * d);
    f.n_members = calloc(d, sizeof(int));
    f.slot = malloc(sizeof(int) * (size_t)nc * d);
    f.group_load = calloc((size_t)n_groups * d + 1, sizeof(int));
    f.pi = calloc(n_nodes, sizeof(double));
    f.dist = malloc(sizeof(double) * n_nodes);
    f.pred = malloc(sizeof(int) * n_nodes);
    f.reached = calloc(n_nodes, sizeof(int));
    f.scanned = calloc(n_nodes, sizeof(int));
    f.heap.items = malloc(sizeof(Entry) * n_arcs);
    int *order = malloc(sizeof(int) * n_nodes); /* the nodes scanned in this run, then its path */
    long total_scanned = -1;
    if (!f.members || !f.n_members || !f.slot || !f.group_load || !f.pi || !f.dist || !f.pred || !f.reached ||
        !f.scanned || !f.heap.items || !order)
        goto done;
    memset(z, 0, (size_t)nc * d);
    for (int p = 0; p < nc; p++) {
        double best = unary[(long)p * d];
        for (int q = 1; q < d; q++) best = unary[(long)p * d + q] > best ? unary[(long)p * d + q] : best;
        f.pi[p] = best;
    }
    *flow_cost = 0.0;
    total_scanned = 0;
    for (int source = 0; source < nc; source++) {
        for (int unit = 0; unit < s; unit++) {
            f.round++;
            f.heap.size = 0;
            f.bound = INFINITY;
            int n_scanned = 0;
            relax(&f, -1, source, 0.0);
            while (f.heap.size > 0) {
                Entry top = heap_pop(&f.heap);
                if (f.scanned[top.node] == f.round) continue;
                f.scanned[top.node] = f.round;
                order[n_scanned++] = top.node;
                if (top.node == f.sink) break;
                scan(&f, top.node, top.key);
            }
            double reach = f.dist[f.sink]; /* a unit of the source always reaches the sink: s <= d */
            *flow_cost += reach - f.pi[source] + f.pi[f.sink]; /* the path's cost: reduced costs telescope */
            for (int i = 0; i < n_scanned; i++) f.pi[order[i]] += f.dist[order[i]] - reach;
            /* the path, source first: a class enters a group node before another leaves it, so a node that
             * stays in use never looks new (and has its potential reset) halfway; only arcs at classes change z */
            int length = 0;
            for (int v = f.sink; v >= 0; v = f.pred[v]) order[length++] = v;
            for (int i = length - 1; i > 0; i--) {
                int u = order[i], v = order[i - 1];
                if (u < nc) enter(&f, u, bucket_of(&f, v));
                else if (v < nc) leave(&f, v, bucket_of(&f, u));
            }
            total_scanned += n_scanned;
        }
    }
done:
    free(f.members), free(f.n_members), free(f.slot), free(f.group_load), free(f.pi), free(f.dist), free(f.pred);
    free(f.reached), free(f.scanned), free(f.heap.items), free(order);
    return total_scanned;
}
