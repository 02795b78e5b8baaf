package main

// Phases and statistics: a phase runs clients of one cell for a fixed time; metrics
// are computed from its samples, ratios within a round, medians over rounds.

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// phase describes one timed run of a cell.
type phase struct {
	clients int           // independent clients, each with its own pool
	hold    time.Duration // busy-spin while holding the lock
	dur     time.Duration
	// distinct gives each client a name of its own (name + "/c" + its index): no
	// contention, only the statements' own cost under concurrency.
	distinct bool
}

// clientName is the name client i takes in a phase on name.
func (p phase) clientName(name string, i int) string {
	if p.distinct {
		return fmt.Sprintf("%s/c%d", name, i)
	}
	return name
}

// sample is one acquisition, in nanoseconds since the phase started.
type sample struct {
	seq        int64 // order in which Acquire returned, from 1
	start, got int64 // Acquire called, Acquire returned
	released   int64 // Release returned
	client     int
}

// phaseResult is what a phase measured.
type phaseResult struct {
	acq       int64
	elapsed   time.Duration
	trips     int64 // round trips on the wire, all clients, during the phase
	oneway    int64
	perClient []int64
	notifies  int64           // PostgreSQL notifications on the library's channels (-1: not counted)
	wait      []time.Duration // Acquire call to return
	handoff   []time.Duration // previous holder's Release returned to Acquire returned
	errs      []error
}

// run opens p.clients clients of c (each with a pool of its own, all counting into
// one wireCount), warms each up with one acquisition of name, then has them all take
// name in a loop for p.dur.
func (p phase) run(ctx context.Context, t *target, c cell, name string) (phaseResult, error) {
	var wc wireCount
	cells, names := make([]cell, p.clients), make([]string, p.clients)
	for i := range cells {
		cells[i], names[i] = c, p.clientName(name, i)
	}
	clients, closeAll, err := openClients(ctx, t, cells, names, &wc)
	defer closeAll()
	if err != nil {
		return phaseResult{}, err
	}

	var (
		seq     atomic.Int64
		wg      sync.WaitGroup
		mu      sync.Mutex
		samples []sample
		errs    []error
	)
	stopCounting, err := countNotifications(ctx, t)
	if err != nil {
		return phaseResult{}, fmt.Errorf("counting notifications: %w", err)
	}
	trips0, oneway0 := wc.trips.Load(), wc.oneway.Load()
	start := time.Now()
	since := func() int64 { return int64(time.Since(start)) }
	deadline := int64(p.dur)
	// Acquire waits at most this long: a phase that hangs is reported, not waited for.
	actx, cancel := context.WithTimeout(ctx, p.dur+time.Minute)
	defer cancel()
	for i, cl := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []sample
			var err error
			for since() < deadline && err == nil {
				s := sample{client: i, start: since()}
				var unlock func(context.Context) error
				unlock, err = cl.lock(actx, p.clientName(name, i))
				if err != nil {
					break
				}
				s.got, s.seq = since(), seq.Add(1)
				for t := time.Now(); time.Since(t) < p.hold; { // the critical section
				}
				err = unlock(actx)
				s.released = since()
				mine = append(mine, s)
			}
			mu.Lock()
			samples = append(samples, mine...)
			if err != nil {
				errs = append(errs, err)
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	r := phaseResult{
		acq:       int64(len(samples)),
		elapsed:   time.Since(start),
		trips:     wc.trips.Load() - trips0,
		oneway:    wc.oneway.Load() - oneway0,
		perClient: make([]int64, p.clients),
		errs:      errs,
		notifies:  stopCounting(),
	}
	// Hand-offs: acquisition k waited for acquisition k-1 if it called Acquire
	// before k-1's Release returned. A waiter may see the lock before the releaser
	// sees its Release return: such hand-offs count as 0.
	relBySeq := make([]int64, len(samples)+2)
	for _, s := range samples {
		if s.seq < int64(len(relBySeq)) {
			relBySeq[s.seq] = s.released
		}
	}
	for _, s := range samples {
		r.perClient[s.client]++
		r.wait = append(r.wait, time.Duration(s.got-s.start))
		if s.seq > 1 && s.seq-1 < int64(len(relBySeq)) {
			if rel := relBySeq[s.seq-1]; rel != 0 && s.start < rel {
				r.handoff = append(r.handoff, time.Duration(max(0, s.got-rel)))
			}
		}
	}
	return r, nil
}

// openClients opens one client of each of cells, each over a pool of its own
// counting into wc, and warms each up (connections, prepared statements) with one
// acquisition of its name in names. closeAll closes the clients, then the pools;
// call it even after an error.
func openClients(ctx context.Context, t *target, cells []cell, names []string, wc *wireCount) (clients []client, closeAll func(), err error) {
	var dbs []*sql.DB
	closeAll = func() {
		for _, cl := range clients {
			cl.close()
		}
		for _, db := range dbs {
			db.Close()
		}
	}
	for _, c := range cells {
		open := t.open
		if c.pool != nil {
			open = func(wc *wireCount) (*sql.DB, error) { return c.pool(t, wc) }
		}
		db, err := open(wc)
		if err != nil {
			return clients, closeAll, err
		}
		dbs = append(dbs, db)
		cl, err := c.open(ctx, db, t.d)
		if err != nil {
			return clients, closeAll, fmt.Errorf("%s: %w", c.name, err)
		}
		clients = append(clients, cl)
	}
	for i, cl := range clients {
		unlock, err := cl.lock(ctx, names[i])
		if err == nil {
			err = unlock(ctx)
		}
		if err != nil {
			return clients, closeAll, fmt.Errorf("%s: warm-up: %w", cells[i].name, err)
		}
	}
	return clients, closeAll, nil
}

// pairSlice is how long each cell of a paired run runs before the next takes over.
const pairSlice = 100 * time.Millisecond

// maxPeerErrors is how many failed pairs a peer's client may have in a paired run
// before the run fails.
const maxPeerErrors = 20

// paired runs one client of each of cs (a cell, then the cells it is compared with)
// in turns of pairSlice, each on a name of its own (name + "/p" + its index), until
// each ran for about dur, and returns the cycles of turns, from which
// pairedRun.ratio gives the ratio of two cells' Acquire+Release pairs per second over
// their own turns. The cells of a paired run share every moment of the machine's drift
// (on the shared 2-core machines here, two runs of one cell a minute apart differed by
// up to 16 %), so their ratio is steadier than that of phases run apart. A failed
// pair of a peer's client (up to maxPeerErrors) is reported on stderr and left out,
// with its time; any other failure ends the run.
func paired(ctx context.Context, t *target, cs []cell, name string, dur time.Duration) (pairedRun, error) {
	// A cell that hangs is reported, not waited for.
	ctx, cancel := context.WithTimeout(ctx, time.Duration(len(cs))*dur+time.Minute)
	defer cancel()
	var wc wireCount
	names := make([]string, len(cs))
	for i := range cs {
		names[i] = fmt.Sprintf("%s/p%d", name, i)
		if err := ensureRow(ctx, t.setup, t.d, names[i]); err != nil {
			return pairedRun{}, err
		}
	}
	clients, closeAll, err := openClients(ctx, t, cs, names, &wc)
	defer closeAll()
	if err != nil {
		return pairedRun{}, err
	}
	pair := func(i int) error {
		unlock, err := clients[i].lock(ctx, names[i])
		if err != nil {
			return fmt.Errorf("%s: %w", cs[i].name, err)
		}
		if err := unlock(ctx); err != nil {
			return fmt.Errorf("%s: %w", cs[i].name, err)
		}
		return nil
	}
	errs := make([]int, len(cs))
	var run pairedRun
	total := newTurns(len(cs))
	for total.spent[len(cs)-1] < dur {
		cy := newTurns(len(cs))
		for i := range cs {
			start := time.Now()
			var lost time.Duration // in failed pairs of a peer
			for time.Since(start) < pairSlice {
				t0 := time.Now()
				if err := pair(i); err != nil {
					// A peer's failure (pglock's heartbeat losing a lock under load) is
					// its own: counted, its time left out, unless it fails often.
					if !cs[i].isPeer || errs[i] >= maxPeerErrors || ctx.Err() != nil {
						return pairedRun{}, err
					}
					if errs[i] == 0 {
						fmt.Fprintf(os.Stderr, "bench: paired: tolerating errors of peer %s: first: %v\n", cs[i].name, err)
					}
					errs[i]++
					lost += time.Since(t0)
					continue
				}
				cy.n[i]++
			}
			cy.spent[i] = time.Since(start) - lost
		}
		run.cycles = append(run.cycles, cy)
		total.add(cy)
	}
	for i, e := range errs {
		if e > 0 {
			fmt.Fprintf(os.Stderr, "bench: paired: peer %s: %d failed pairs left out (%d counted)\n", cs[i].name, e, total.n[i])
		}
	}
	return run, nil
}

// pairedRun is the outcome of paired: the cycles (one turn of every cell) it was
// made of.
type pairedRun struct {
	cycles []turns
}

// turns are the pairs each cell completed in one cycle (or several), and the time
// each took.
type turns struct {
	n     []int64
	spent []time.Duration
}

func newTurns(cells int) turns {
	return turns{n: make([]int64, cells), spent: make([]time.Duration, cells)}
}

// add adds c's pairs and times to t's.
func (t turns) add(c turns) {
	for i := range t.n {
		t.n[i] += c.n[i]
		t.spent[i] += c.spent[i]
	}
}

// ratio is cell a's pairs per second over cell b's (0 if either has none).
func (t turns) ratio(a, b int) float64 {
	if t.n[b] == 0 || t.spent[a] == 0 {
		return 0
	}
	return (float64(t.n[a]) / t.spent[a].Seconds()) / (float64(t.n[b]) / t.spent[b].Seconds())
}

// ratio is cell a's pairs per second over cell b's, over the whole run.
func (r pairedRun) ratio(a, b int) float64 {
	sum := newTurns(len(r.cycles[0].n))
	for _, c := range r.cycles {
		sum.add(c)
	}
	return sum.ratio(a, b)
}

// interval returns a 90 % bootstrap interval of the ratio of cell a's rate to cell
// b's: the cycles are resampled with replacement (2,000 times, a fixed seed, so a
// run's JSON can be recomputed) and the ratio of the sums taken each time. It
// reflects the machine's noise within the run (the cells' turns are paired), not
// between runs.
func (r pairedRun) interval(a, b int) (lo, hi float64, ok bool) {
	if len(r.cycles) < 5 {
		return 0, 0, false
	}
	rng := rand.New(rand.NewPCG(1, 2))
	ratios := make([]float64, 0, 2000)
	for range 2000 {
		sum := newTurns(len(r.cycles[0].n))
		for range r.cycles {
			sum.add(r.cycles[rng.IntN(len(r.cycles))])
		}
		if x := sum.ratio(a, b); x > 0 {
			ratios = append(ratios, x)
		}
	}
	if len(ratios) < 1000 {
		return 0, 0, false
	}
	slices.Sort(ratios)
	return ratios[len(ratios)*5/100], ratios[len(ratios)*95/100], true
}

// percentile returns the p-th quantile (0..1) of ds by nearest rank, sorting ds.
func percentile(ds []time.Duration, p float64) (time.Duration, bool) {
	if len(ds) == 0 {
		return 0, false
	}
	slices.Sort(ds)
	i := int(math.Ceil(p*float64(len(ds)))) - 1
	return ds[max(0, min(i, len(ds)-1))], true
}

// Metric names, also the keys of the JSON output. Durations are in microseconds.
const (
	mPairs       = "uncontended_pairs_per_s"
	mStmtsUnc    = "uncontended_stmts_per_acq"
	mOnewayUnc   = "uncontended_oneway_per_acq"
	mXRaw        = "uncontended_x_raw"
	mXFloor      = "uncontended_x_floor"
	mXPeer       = "uncontended_x_peer"
	mXRawPaired  = "paired_x_raw"    // uncontended, in turns with the raw cell (paired)
	mXPeerPaired = "paired_x_peer"   // uncontended, in turns with the peer cell (paired)
	mXRawLo      = "paired_x_raw_p5" // the 90 % bootstrap interval of paired_x_raw (pairedRun.interval)
	mXRawHi      = "paired_x_raw_p95"
	mXPeerLo     = "paired_x_peer_p5" // and of paired_x_peer
	mXPeerHi     = "paired_x_peer_p95"
	mC1          = "contended1_acq_per_s"
	mCN          = "contended_acq_per_s"
	mCNXRaw      = "contended_x_raw"
	mStmtsCN     = "contended_stmts_per_acq"
	mMinShare    = "contended_min_share_pct"
	mWaitP50     = "contended_wait_p50_us"
	mWaitP99     = "contended_wait_p99_us"
	mHandoffP50  = "contended_handoff_p50_us"
	mHandoffP99  = "contended_handoff_p99_us"
	mNotifyCN    = "contended_notifies_per_acq"
	mDist        = "distinct_acq_per_s"
	mDistXRaw    = "distinct_x_raw"
	mNotifyDist  = "distinct_notifies_per_acq"
	mErrors      = "errors"
)

// metrics of one cell in one round; a missing key means "not measured".
type metrics map[string]float64

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// uncontended records the single-client phase without hold.
func (m metrics) uncontended(r phaseResult) {
	m[mPairs] = float64(r.acq) / r.elapsed.Seconds()
	if r.acq > 0 {
		m[mStmtsUnc] = float64(r.trips) / float64(r.acq)
		m[mOnewayUnc] = float64(r.oneway) / float64(r.acq)
	}
	m[mErrors] += float64(len(r.errs))
}

// contended1 records the single-client phase with hold.
func (m metrics) contended1(r phaseResult) {
	m[mC1] = float64(r.acq) / r.elapsed.Seconds()
	m[mErrors] += float64(len(r.errs))
}

// contended records the phase of several clients on one name.
func (m metrics) contended(r phaseResult) {
	m[mCN] = float64(r.acq) / r.elapsed.Seconds()
	m[mErrors] += float64(len(r.errs))
	if r.acq == 0 {
		return
	}
	m[mStmtsCN] = float64(r.trips) / float64(r.acq)
	if r.notifies >= 0 {
		m[mNotifyCN] = float64(r.notifies) / float64(r.acq)
	}
	m[mMinShare] = 100 * float64(slices.Min(r.perClient)) / float64(r.acq)
	if v, ok := percentile(r.wait, 0.50); ok {
		m[mWaitP50] = us(v)
	}
	if v, ok := percentile(r.wait, 0.99); ok {
		m[mWaitP99] = us(v)
	}
	if v, ok := percentile(r.handoff, 0.50); ok {
		m[mHandoffP50] = us(v)
	}
	if v, ok := percentile(r.handoff, 0.99); ok {
		m[mHandoffP99] = us(v)
	}
}

// distinct records the phase of many clients on names of their own.
func (m metrics) distinct(r phaseResult) {
	m[mDist] = float64(r.acq) / r.elapsed.Seconds()
	m[mErrors] += float64(len(r.errs))
	if r.notifies >= 0 && r.acq > 0 {
		m[mNotifyDist] = float64(r.notifies) / float64(r.acq)
	}
}

// ratios sets, within one round, each cell's ratios to its raw cell, its peer and
// the floor.
func ratios(cells []cell, round map[string]metrics) {
	var floor metrics
	for _, c := range cells {
		if c.floor {
			floor = round[c.name]
		}
	}
	ratio := func(m metrics, key string, other metrics, okey string) {
		if other == nil || other[okey] == 0 {
			return
		}
		if v, ok := m[okey]; ok {
			m[key] = v / other[okey]
		}
	}
	for _, c := range cells {
		m := round[c.name]
		if m == nil {
			continue
		}
		ratio(m, mXFloor, floor, mPairs)
		if c.raw != "" {
			ratio(m, mXRaw, round[c.raw], mPairs)
			ratio(m, mCNXRaw, round[c.raw], mCN)
			ratio(m, mDistXRaw, round[c.raw], mDist)
		}
		if c.peer != "" {
			ratio(m, mXPeer, round[c.peer], mPairs)
		}
	}
}

// median returns, for every key, the median over rounds of the rounds that have it.
func median(rounds []metrics) metrics {
	out := metrics{}
	keys := map[string]bool{}
	for _, r := range rounds {
		for k := range r {
			keys[k] = true
		}
	}
	for k := range keys {
		var vs []float64
		for _, r := range rounds {
			if v, ok := r[k]; ok {
				vs = append(vs, v)
			}
		}
		slices.Sort(vs)
		n := len(vs)
		if n%2 == 1 {
			out[k] = vs[n/2]
		} else {
			out[k] = (vs[n/2-1] + vs[n/2]) / 2
		}
	}
	return out
}
