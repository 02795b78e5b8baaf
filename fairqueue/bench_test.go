package fairqueue_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/fairqueue"
	"github.com/sqllock/sqllock/testdb"
	"github.com/sqllock/sqllock/uniqueindex"
)

// Benchmarks. Run them with, for example:
//
//	go test -run '^$' -bench . -benchtime 3s ./fairqueue/
//
// Every simulated replica has a pool and a Locker of its own. Statements are counted
// as they are sent (testdb.OpenCounting).

// BenchmarkUncontended: Acquire+Release of one name, interleaved with uniqueindex's
// in the same run. x-uniqueindex is fairqueue's throughput as a fraction of
// uniqueindex's.
func BenchmarkUncontended(b *testing.B) {
	for _, d := range testdb.Dialects {
		b.Run(d.String(), func(b *testing.B) {
			var n atomic.Int64
			db := testdb.OpenCounting(b, d, &n)
			ctx := context.Background()
			fq, err := fairqueue.New(db, d)
			if err != nil {
				b.Fatal(err)
			}
			defer fq.Close()
			ui, err := uniqueindex.New(db, d)
			if err != nil {
				b.Fatal(err)
			}
			defer ui.Close()
			name := testdb.Name(b)
			var tFQ, tUI time.Duration
			var sFQ int64
			cycle := func(l sqllock.Locker) {
				lease, err := l.Acquire(ctx, name)
				if err != nil {
					b.Fatal(err)
				}
				if err := lease.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0, s0 := time.Now(), n.Load()
				cycle(fq)
				t1 := time.Now()
				sFQ += n.Load() - s0
				cycle(ui)
				tFQ += t1.Sub(t0)
				tUI += time.Since(t1)
			}
			b.StopTimer()
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(float64(tFQ.Nanoseconds())/float64(b.N), "fairqueue-ns/op")
			b.ReportMetric(float64(tUI.Nanoseconds())/float64(b.N), "uniqueindex-ns/op")
			b.ReportMetric(float64(tUI)/float64(tFQ), "x-uniqueindex")
			b.ReportMetric(float64(sFQ)/float64(b.N), "fairqueue-stmts/op")
		})
	}
}

// BenchmarkContended: 8 replicas (a pool and a Locker each) with 1 or 4 goroutines
// each (8 or 32 waiters) take one name b.N times in all, each holding it about 100µs.
// Reported: statements per acquisition (counted as sent, keep-alives included), the
// smallest share of the acquisitions a replica got (12.5 % is fair), and the hand-off
// latency from a Release returning to the next holder's Acquire returning (p50, p99).
func BenchmarkContended(b *testing.B) {
	const replicas, hold = 8, 100 * time.Microsecond
	for _, d := range testdb.Dialects {
		for _, each := range []int{1, 4} {
			b.Run(fmt.Sprintf("%v/waiters=%d", d, replicas*each), func(b *testing.B) {
				ctx := context.Background()
				var sent atomic.Int64
				lockers := make([]*fairqueue.Locker, replicas)
				for i := range lockers {
					l, err := fairqueue.New(testdb.OpenCounting(b, d, &sent), d)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { l.Close() })
					lockers[i] = l
				}
				name := testdb.Name(b)
				var (
					left       atomic.Int64
					released   atomic.Int64 // UnixNano of the last Release's return
					mu         sync.Mutex
					handoffs   []time.Duration
					perReplica = make([]atomic.Int64, replicas)
					wg         sync.WaitGroup
				)
				left.Store(int64(b.N))
				b.ResetTimer()
				before := sent.Load()
				for r := 0; r < replicas; r++ {
					for g := 0; g < each; g++ {
						wg.Add(1)
						go func() {
							defer wg.Done()
							for left.Add(-1) >= 0 {
								le, err := lockers[r].Acquire(ctx, name)
								if err != nil {
									b.Error(err)
									return
								}
								if at := released.Load(); at != 0 {
									mu.Lock()
									handoffs = append(handoffs, time.Since(time.Unix(0, at)))
									mu.Unlock()
								}
								perReplica[r].Add(1)
								t := time.Now()
								for time.Since(t) < hold { // the critical section
								}
								if err := le.Release(ctx); err != nil {
									b.Error(err)
									return
								}
								released.Store(time.Now().UnixNano())
							}
						}()
					}
				}
				wg.Wait()
				b.StopTimer()
				stmts := sent.Load() - before
				minShare := int64(b.N)
				for i := range perReplica {
					minShare = min(minShare, perReplica[i].Load())
				}
				slices.Sort(handoffs)
				pct := func(p float64) float64 {
					if len(handoffs) == 0 {
						return 0
					}
					return float64(handoffs[int(p*float64(len(handoffs)-1))].Microseconds())
				}
				b.ReportMetric(float64(stmts)/float64(b.N), "stmts/acq")
				b.ReportMetric(100*float64(minShare)/float64(b.N), "min-share-%")
				b.ReportMetric(pct(0.5), "handoff-p50-µs")
				b.ReportMetric(pct(0.99), "handoff-p99-µs")
			})
		}
	}
}
