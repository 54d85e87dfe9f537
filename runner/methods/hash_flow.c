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
 * deficit) keeps it so. One augmentation per unit, each path found by a Dijkstra run on the reduced costs:
 * - backward, from the sink over the residual arcs reversed, stopped when a class with excess is scanned at
 *   distance D; pi(v) += D - dist(v) on the nodes below D. It finds the cheapest path of any class with excess:
 *   when the classes are alike (a shared preference, a spread below beta) this leaves out the long chains of swaps
 *   that a fixed class order forces on a search from each class (6.3 -> 1.9 ms a cascade at d = 128, ks = 4).
 * - forward, once few classes have units left (`forward_sources`), from those classes (each starts at the gap
 *   between its potential and their largest: arcs of cost 0 from one source) until the sink is scanned at D;
 *   pi(v) -= D - dist(v). A backward run makes the reduced distance to the sink of every node it scans 0, so the
 *   next backward run scans them all again before it meets the last classes; a forward run's potentials then
 *   steer it to the sink like A*'s heuristic (npairs ks = 2 cascades: 6-11% less time; at d = 128 a forward
 *   run's d arcs a class can cost more than it saves, hence the few classes it starts from).
 * Either update keeps the reduced costs >= 0 and makes the path's 0. Start: pi(p) = max_q c_p[q],
 * pi(q) = min_p (pi(p) - c_p[q]) >= 0 (the least reduced cost into q, so a search meets first the buckets some
 * class wants), pi(sink) = 0. Not done: several paths a run (primal-dual): with float unaries two paths rarely
 * cost the same, so the admissible graph of a run holds one path.
 *
 * Eager nodes: a node with a cheap scan whose arcs lead to queued nodes is scanned at each new distance of its
 * instead of queued (its arcs cost >= 0, so its heads end with the labels one scan at its final distance gives):
 * backward, a class without excess or siblings reached from a bucket (a bucket's scan reaches most classes, and
 * such a class backs out of its s buckets); either way, the node (r, q) of a group whose classes never share a
 * bucket (`siblings_never_share`: its one class in q is its only way on). That group's arcs priced alpha are
 * gone, as no minimiser uses them. The heap knows each node's place, so a node is in it once.
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

#define ARITY 4 /* the heap's children a place: fewer levels than a binary heap's, each read in one cache line */

typedef struct {
    double key;
    int node;
} Entry;

/* A min-heap of nodes (ARITY children a place) that knows each node's place, so a node is in it once and its key
 * only decreases: a search scans each node it pops. */
typedef struct {
    Entry *items;
    int *place; /* per node: its index in items while it is there */
    int size;
} Heap;

static void put(Heap *h, int i, Entry item) {
    h->items[i] = item;
    h->place[item.node] = i;
}

/* Put `item` at place i or above it, moving larger parents down. */
static void sift_up(Heap *h, int i, Entry item) {
    while (i > 0) {
        int parent = (i - 1) / ARITY;
        if (h->items[parent].key <= item.key) break;
        put(h, i, h->items[parent]);
        i = parent;
    }
    put(h, i, item);
}

/* Put `item` at place i or below it, moving smaller children up. */
static void sift_down(Heap *h, int i, Entry item) {
    for (;;) {
        int first = ARITY * i + 1, last = first + ARITY < h->size ? first + ARITY : h->size, child = first;
        if (first >= h->size) break;
        for (int c = first + 1; c < last; c++)
            if (h->items[c].key < h->items[child].key) child = c;
        if (item.key <= h->items[child].key) break;
        put(h, i, h->items[child]);
        i = child;
    }
    put(h, i, item);
}

static Entry heap_pop(Heap *h) {
    Entry top = h->items[0];
    if (--h->size > 0) sift_down(h, 0, h->items[h->size]);
    return top;
}

typedef struct {
    int nc, d, s, sink, n_nodes;
    const double *unary, *unary_t; /* (nc, d) and its transpose (d, nc) */
    const int *group, *group_start, *group_members; /* a class's sibling group; each group's classes (CSR) */
    const unsigned char *shares; /* per group: its classes may share a bucket (else its arcs priced alpha are gone) */
    double alpha, beta;
    unsigned char *z;
    int *members, *n_members, *slot; /* classes per bucket (d x nc), their count, a class's place in its list */
    int *held, *n_held;              /* the buckets a class is in (nc x s), their count */
    int *group_load;                 /* y_rq, (n_groups x d) */
    unsigned char *direct;           /* (d x nc): class p enters bucket q directly (not in q, no sibling there) */
    int *excess;                     /* units a class has still to send */
    double *pi, *dist;
    int *link, *reached, *scanned, round; /* link: the node a node was reached from */
    int *order, n_order; /* the nodes this run reached: those at less than the goal's distance move their potential */
    int n_scanned;       /* this run's: the goal and the nodes at less than its distance */
    int forward; /* this run searches from the classes with excess to the sink (else from the sink back) */
    double bound; /* the goal's best tentative distance: no node at or beyond it is scanned before the goal */
    Heap heap;
} Flow;

static int group_node(const Flow *f, int r, int q) { return f->sink + 1 + r * f->d + q; }

/* The bucket of a bucket node or of a group node. */
static int bucket_of(const Flow *f, int node) { return node < f->sink ? node - f->nc : (node - f->sink - 1) % f->d; }

static void scan(Flow *f, int v, double at);

/* Give `to` the tentative distance `distance`, through `from`. A node at or beyond the goal's tentative distance
 * (`bound`; the goal: the sink searching forward, a class with excess backward) is never scanned before the goal,
 * so it stays out of the heap. */
static void label(Flow *f, int from, int to, double distance);

static inline void relax(Flow *f, int from, int to, double distance) { /* inlined: most calls change nothing */
    /* A reduced cost rounded below 0 (ties, float potentials) counts as 0: no label is below the one it came
     * from, so the links stay a tree where an eager node, scanned before its final label, is labelled again. */
    if (distance < f->dist[from]) distance = f->dist[from];
    if (distance < f->bound && f->scanned[to] != f->round && (f->reached[to] != f->round || distance < f->dist[to]))
        label(f, from, to, distance);
}

/* Whether `to`, reached from `from`, is scanned at once at each new distance instead of queued: a node whose scan is
 * cheap and whose arcs' heads are heap nodes (so the recursion stops there). Scanning it at every new distance
 * gives those heads the labels its one scan would (its arcs cost >= 0), without its heap work: backward, a class
 * without excess reached from a bucket (a bucket's scan reaches most classes; a class backs out of its s buckets);
 * either way, the node of a sibling group that never shares a bucket (its one class there is its only way on). */
static int eager(const Flow *f, int from, int to) {
    if (to > f->sink) return !f->shares[(to - f->sink - 1) / f->d];
    return !f->forward && to < f->nc && f->excess[to] == 0 && from < f->sink && f->group[to] < 0;
}

static void label(Flow *f, int from, int to, double distance) {
    int queued = f->reached[to] == f->round && f->heap.place[to] >= 0;
    if (f->reached[to] != f->round) { /* the potentials move on the nodes reached before the goal's distance */
        f->reached[to] = f->round;
        f->heap.place[to] = -1;
        f->order[f->n_order++] = to;
    }
    f->dist[to] = distance;
    f->link[to] = from;
    if (eager(f, from, to)) {
        scan(f, to, distance); /* a key left in the heap is stale: the scan on popping reads dist */
    } else {
        sift_up(&f->heap, queued ? f->heap.place[to] : f->heap.size++, (Entry){distance, to});
        if (f->forward ? to == f->sink : to < f->nc && f->excess[to] > 0) f->bound = distance;
    }
}

/* Backward, class p at distance `at` from the sink: back out of each bucket it is in (through its group's node). */
static void back_out(Flow *f, int p, double at) {
    int r = f->group[p];
    for (int i = 0; i < f->n_held[p]; i++) {
        int q = f->held[p * f->s + i], u = r >= 0 ? group_node(f, r, q) : f->nc + q;
        relax(f, p, u, at + f->unary[(long)p * f->d + q] + f->pi[u] - f->pi[p]);
    }
}

/* Backward: relax the residual arcs into v (a bucket or a group node), at distance `at` from the sink. */
static void scan_backward(Flow *f, int v, double at) {
    int nc = f->nc, d = f->d;
    const double *pi = f->pi;
    if (v < f->sink) { /* bucket q: a class not in it enters directly, a group node in use forwards */
        int q = v - nc;
        const double *c = f->unary_t + (long)q * nc;
        const unsigned char *direct = f->direct + (long)q * nc; /* the others enter through their group's node */
        double from = at - pi[v], *class_dist = f->dist; /* a class not yet reached this run is at +inf */
        for (int p = 0; p < nc; p++) { /* the hot loop: most classes are cut by the bound or their label */
            double distance = from - c[p] + pi[p];
            if ((distance < f->bound) & (distance < class_dist[p]) & direct[p]) relax(f, v, p, distance);
        }
        for (int i = 0; i < f->n_members[q]; i++) {
            int r = f->group[f->members[q * nc + i]], u = r >= 0 ? group_node(f, r, q) : -1;
            if (r >= 0 && f->shares[r]) relax(f, v, u, from + f->group_load[r * d + q] * f->alpha + pi[u]);
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

/* Forward: relax the residual arcs out of v, which is at distance `at` from the classes with excess. */
static void scan_forward(Flow *f, int v, double at) {
    int nc = f->nc, d = f->d;
    const double *pi = f->pi;
    double from = at + pi[v];
    if (v < nc) { /* class p: into each bucket it is not in, through its group's node there when in use */
        int p = v, r = f->group[p];
        const double *c = f->unary + (long)p * d;
        const unsigned char *z = f->z + (long)p * d;
        const int *load = r >= 0 ? f->group_load + (long)r * d : NULL; /* y_rq of p's group */
        for (int q = 0; q < d; q++) {
            if (z[q]) continue;
            int u = load && load[q] ? group_node(f, r, q) : nc + q;
            double distance = from - c[q] - pi[u];
            if (distance < f->bound) relax(f, v, u, distance);
        }
    } else if (v < f->sink) { /* bucket q: a unit on to the sink, or one back to a class (group node) in q */
        int q = v - nc;
        relax(f, v, f->sink, from + f->n_members[q] * f->beta - pi[f->sink]);
        for (int i = 0; i < f->n_members[q]; i++) {
            int p = f->members[q * nc + i], r = f->group[p];
            if (r < 0) {
                relax(f, v, p, from + f->unary[(long)p * d + q] - pi[p]);
            } else {
                int u = group_node(f, r, q);
                relax(f, v, u, from - (f->group_load[r * d + q] - 1) * f->alpha - pi[u]);
            }
        }
    } else { /* group node (r, q) in use: on into bucket q, or back to a class of r in q */
        int r = (v - f->sink - 1) / d, q = bucket_of(f, v);
        if (f->shares[r]) relax(f, v, nc + q, from + f->group_load[r * d + q] * f->alpha - pi[nc + q]);
        for (int i = f->group_start[r]; i < f->group_start[r + 1]; i++) {
            int p = f->group_members[i];
            if (f->z[(long)p * d + q]) relax(f, v, p, from + f->unary[(long)p * d + q] - pi[p]);
        }
    }
}

/* Relax the residual arcs of v, at distance `at` from where the search started (into v backward, out of it forward). */
static void scan(Flow *f, int v, double at) {
    if (f->forward) scan_forward(f, v, at);
    else if (v < f->nc) back_out(f, v, at);
    else scan_backward(f, v, at);
}

/* One shortest path from a class with excess to the sink, on the reduced costs: searched forward from the
 * `n_sources` classes with excess, each starting at the gap between its potential and their largest (a source of
 * arcs to them of cost 0), or backward from the sink, which is scanned first with its d in-arcs heapified at once.
 * Writes the path, source first, and the nodes scanned; moves their potentials by their distance left to the goal,
 * which keeps every reduced cost >= 0 and makes the path's 0; returns the path's cost, which its reduced costs
 * telescope to: the distance found less the potentials at its ends. */
static double shortest_path(Flow *f, int forward, int n_sources, int *path, int *n_path) {
    int nc = f->nc, d = f->d, goal, *start = path; /* the start nodes, then the path, share one buffer */
    double top = -INFINITY;
    f->round++;
    f->forward = forward;
    f->bound = INFINITY;
    f->n_order = 0;
    for (int p = 0; p < nc; p++) f->dist[p] = INFINITY; /* for the bucket scans' test */
    if (forward) {
        for (int p = 0, i = 0; p < nc; p++)
            if (f->excess[p] > 0) top = fmax(top, f->pi[start[i++] = p]);
        for (int i = 0; i < n_sources; i++) f->dist[start[i]] = top - f->pi[start[i]];
    } else {
        f->scanned[f->sink] = f->round;
        f->dist[f->sink] = 0.0;
        f->order[f->n_order++] = f->sink;
        for (int q = 0; q < d; q++) f->dist[start[q] = nc + q] = f->n_members[q] * f->beta + f->pi[nc + q] - f->pi[f->sink];
    }
    int n_start = forward ? n_sources : d;
    for (int i = 0; i < n_start; i++) {
        int v = start[i];
        f->reached[v] = f->round;
        f->link[v] = forward ? -1 : f->sink;
        f->order[f->n_order++] = v;
        put(&f->heap, i, (Entry){f->dist[v], v});
    }
    f->heap.size = n_start;
    for (int i = (n_start - 2) / ARITY; i >= 0; i--) sift_down(&f->heap, i, f->heap.items[i]);
    for (goal = -1; goal < 0;) { /* the goal is reached: s <= d, and g s <= d in a group that never shares */
        if (f->heap.size == 0) return NAN;
        int v = heap_pop(&f->heap).node;
        f->scanned[v] = f->round;
        if (forward ? v == f->sink : v < nc && f->excess[v] > 0) goal = v;
        else scan(f, v, f->dist[v]);
    }
    double reach = f->dist[goal], cost = reach - (forward ? top : f->pi[goal]) + f->pi[f->sink];
    f->n_scanned = 1; /* the goal, and each node reached at less than its distance (all of those were scanned) */
    for (int i = 0; i < f->n_order; i++) {
        int v = f->order[i];
        if (f->dist[v] < reach) {
            f->pi[v] += (forward ? -1 : 1) * (reach - f->dist[v]);
            f->n_scanned++;
        }
    }
    *n_path = 0;
    if (forward) { /* a path visits each node once: a longer one would follow a broken link */
        for (int v = f->sink; v >= 0; v = f->link[v]) {
            if (*n_path == f->n_nodes) return NAN;
            path[(*n_path)++] = v;
        }
        for (int i = 0, j = *n_path - 1; i < j; i++, j--) {
            int v = path[i];
            path[i] = path[j], path[j] = v;
        }
    } else {
        for (int v = goal; v != f->sink; v = f->link[v]) {
            if (*n_path == f->n_nodes - 1) return NAN;
            path[(*n_path)++] = v;
        }
        path[(*n_path)++] = f->sink;
    }
    return cost;
}

/* Whether the classes of group r enter bucket q directly: only while none of them is in it. */
static void set_direct(Flow *f, int r, int q, unsigned char value) {
    for (int i = f->group_start[r]; i < f->group_start[r + 1]; i++)
        f->direct[(long)q * f->nc + f->group_members[i]] = value;
}

static void enter(Flow *f, int p, int q) {
    f->z[(long)p * f->d + q] = 1;
    f->direct[(long)q * f->nc + p] = 0;
    f->slot[(long)p * f->d + q] = f->n_members[q];
    f->members[q * f->nc + f->n_members[q]++] = p;
    f->held[p * f->s + f->n_held[p]++] = q;
    int r = f->group[p];
    if (r >= 0 && f->group_load[r * f->d + q]++ == 0) {
        f->pi[group_node(f, r, q)] = f->pi[f->nc + q];
        set_direct(f, r, q, 0);
    }
}

static void leave(Flow *f, int p, int q) {
    f->z[(long)p * f->d + q] = 0;
    int i = f->slot[(long)p * f->d + q], last = f->members[q * f->nc + --f->n_members[q]];
    f->members[q * f->nc + i] = last;
    f->slot[(long)last * f->d + q] = i;
    int *held = f->held + p * f->s, j = 0;
    while (held[j] != q) j++;
    held[j] = held[--f->n_held[p]];
    int r = f->group[p];
    if (r < 0) f->direct[(long)q * f->nc + p] = 1;
    else if (--f->group_load[r * f->d + q] == 0) set_direct(f, r, q, 1);
}

/* One level: unary (nc, d) row-major; group (nc) the class's sibling group in [0, n_groups), or -1 for a class
 * without siblings; shares (n_groups) 1 where a group's classes may share a bucket at a minimiser (else its arcs
 * priced alpha, which no minimiser uses, are left out); s units per class, 1 <= s <= d; a run searches forward
 * once at most `forward_sources` classes have units left. Writes z (nc, d) of 0/1 and the flow's cost (the sum of
 * the augmenting paths' costs, = E(z)); returns the nodes scanned over all runs, -1 when out of memory, or -2
 * when a class finds no path to the sink (shares claims a group never shares where it must), or its path's
 * links go round (not met in tests and fuzzing since `relax` counts a rounded-negative reduced cost as 0). */
long hash_flow(int nc, int d, int s, const double *unary, const int *group, int n_groups, const unsigned char *shares,
               double alpha, double beta, int forward_sources, unsigned char *z, double *flow_cost) {
    int n_nodes = nc + d + 1 + n_groups * d;
    Flow f = {nc, d, s, nc + d, n_nodes, unary, NULL, group, NULL, NULL, shares, alpha, beta, z};
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
    f.direct = malloc((size_t)nc * d);
    f.excess = malloc(sizeof(int) * nc);
    f.pi = calloc(n_nodes, sizeof(double));
    f.dist = malloc(sizeof(double) * n_nodes);
    f.link = malloc(sizeof(int) * n_nodes);
    f.reached = calloc(n_nodes, sizeof(int));
    f.scanned = calloc(n_nodes, sizeof(int));
    f.heap.items = malloc(sizeof(Entry) * n_nodes);
    f.heap.place = malloc(sizeof(int) * n_nodes);
    int *path = malloc(sizeof(int) * n_nodes);
    f.order = malloc(sizeof(int) * n_nodes);
    long total_scanned = -1;
    if (!unary_t || !group_start || !group_members || !f.members || !f.n_members || !f.slot || !f.held ||
        !f.n_held || !f.group_load || !f.direct || !f.excess || !f.pi || !f.dist || !f.link || !f.reached || !f.scanned ||
        !f.heap.items || !f.heap.place || !f.order || !path)
        goto done;
    memset(z, 0, (size_t)nc * d);
    memset(f.direct, 1, (size_t)nc * d);
    for (int p = 0; p < nc; p++) {
        const double *c = unary + (long)p * d;
        double best = c[0];
        for (int q = 1; q < d; q++) best = c[q] > best ? c[q] : best;
        f.pi[p] = best;
        f.excess[p] = s;
        if (group[p] >= 0) group_start[group[p] + 2]++;
    }
    for (int q = 0; q < d; q++) { /* the transpose, written in order; pi(q) = the least reduced cost of a class
                                   * into q, so its in-arcs keep >= 0 */
        double *column = unary_t + (long)q * nc, least = INFINITY;
        for (int p = 0; p < nc; p++) {
            column[p] = unary[(long)p * d + q];
            least = f.pi[p] - column[p] < least ? f.pi[p] - column[p] : least;
        }
        f.pi[nc + q] = least;
    }
    for (int r = 0; r < n_groups; r++) group_start[r + 2] += group_start[r + 1];
    for (int p = 0; p < nc; p++)
        if (group[p] >= 0) group_members[group_start[group[p] + 1]++] = p;
    *flow_cost = 0.0;
    total_scanned = 0;
    for (int unit = 0, n_sources = nc; unit < nc * s; unit++) {
        int n_path;
        double cost = shortest_path(&f, n_sources <= forward_sources, n_sources, path, &n_path);
        if (isnan(cost)) { /* no path (shares wrong), or a broken one: not a level this code can solve */
            total_scanned = -2;
            break;
        }
        *flow_cost += cost;
        /* along the path, source first: a class enters a group node before another leaves it, so a node that stays
         * in use never looks new (and has its potential reset) halfway; only arcs at classes change z */
        for (int i = 0; i + 1 < n_path; i++) {
            int u = path[i], v = path[i + 1];
            if (u < nc) enter(&f, u, bucket_of(&f, v));
            else if (v < nc) leave(&f, v, bucket_of(&f, u));
        }
        n_sources -= --f.excess[path[0]] == 0;
        total_scanned += f.n_scanned;
    }
done:
    free(unary_t), free(group_start), free(group_members), free(f.members), free(f.n_members), free(f.slot);
    free(f.held), free(f.n_held), free(f.group_load), free(f.direct), free(f.excess), free(f.pi), free(f.dist), free(f.link);
    free(f.reached), free(f.scanned), free(f.heap.items), free(f.heap.place), free(f.order), free(path);
    return total_scanned;
}
