package main

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

var (
	acquiredRe = regexp.MustCompile(`^t=[0-9.]+s replica=(\d+) acquired token=(-?\d+) waiters=(\d+)$`)
	handoffRe  = regexp.MustCompile(`^handoff from=(\d+) to=(\d+) after=\S+$`)
)

// TestDemo runs `sqllock demo` as a user would, with -dsn and --no-tty, for every
// strategy, and checks its output: hand-offs happen, tokens increase, no overlaps,
// exit status 0.
func TestDemo(t *testing.T) {
	testdb.ForEach(t, func(t *testing.T, d sqllock.Dialect) {
		dsn := testdb.DSN(t, d)
		for _, s := range demoStrategies {
			t.Run(s, func(t *testing.T) {
				out, err := runCLI(t, "demo", "-dsn", dsn, "-strategy", s, "-replicas", "3",
					"-duration", "1500ms", "-job", "60ms", "--no-tty", "-name", testdb.Name(t, "demo"))
				if err != nil {
					t.Fatalf("demo: %v\n%s", err, out)
				}
				var (
					handoffs, acquisitions int
					last                   int64
					summary                string
				)
				for _, ln := range strings.Split(strings.TrimSpace(out), "\n") {
					if m := acquiredRe.FindStringSubmatch(ln); m != nil {
						tok, _ := strconv.ParseInt(m[2], 10, 64)
						if acquisitions > 0 && tok <= last {
							t.Errorf("token %d after %d: %s", tok, last, ln)
						}
						last = tok
						acquisitions++
					}
					if m := handoffRe.FindStringSubmatch(ln); m != nil {
						if m[1] == m[2] {
							t.Errorf("hand-off to itself: %s", ln)
						}
						handoffs++
					}
					if strings.HasPrefix(ln, "demo: ") && strings.Contains(ln, "hand-offs") {
						summary = ln
					}
					if strings.Contains(ln, "OVERLAP") || strings.Contains(ln, " error: ") {
						t.Errorf("%s", ln)
					}
				}
				if handoffs < 2 {
					t.Errorf("%d hand-offs, want >= 2", handoffs)
				}
				want := "demo: " + strconv.Itoa(handoffs) + " hand-offs, tokens increasing: yes, overlaps: 0 "
				if !strings.HasPrefix(summary, want) {
					t.Errorf("summary %q, want prefix %q", summary, want)
				}
				if t.Failed() {
					t.Logf("output:\n%s", out)
				} else {
					t.Logf("%s", summary)
				}
			})
		}
	})
}

func TestDemoUsage(t *testing.T) {
	for _, args := range [][]string{
		{"demo", "-strategy", "nope", "-dsn", "postgres://x@127.0.0.1:1/x"},
		{"demo", "-replicas", "0"},
		{"demo", "extra"},
	} {
		if _, err := runCLI(t, args...); err == nil {
			t.Errorf("run(%q) succeeded", args)
		}
	}
}

// fakeLease is a Lease for the bookkeeping test.
type fakeLease struct {
	tok int64
	err error
}

func (f *fakeLease) Name() string                  { return "x" }
func (f *fakeLease) Token() int64                  { return f.tok }
func (f *fakeLease) Done() <-chan struct{}         { return nil }
func (f *fakeLease) Err() error                    { return f.err }
func (f *fakeLease) Release(context.Context) error { return nil }

// TestDemoBookkeeping: the demo's own account catches two live holders and a token
// that does not increase, and does not count a holder whose lease is lost.
func TestDemoBookkeeping(t *testing.T) {
	var out strings.Builder
	st := &demoState{out: &out, n: 3, states: make([]string, 4), holders: map[int]sqllock.Lease{}, start: time.Now()}
	a := &fakeLease{tok: 5}
	st.acquired(1, a)
	st.acquired(2, &fakeLease{tok: 4}) // 1 still holds, and 4 < 5
	if st.overlaps != 1 || st.tokensOK {
		t.Errorf("overlaps %d tokensOK %v, want 1 false\n%s", st.overlaps, st.tokensOK, out.String())
	}
	st = &demoState{out: &out, n: 3, states: make([]string, 4), holders: map[int]sqllock.Lease{}, start: time.Now()}
	lost := &fakeLease{tok: 5}
	st.acquired(1, lost)
	lost.err = sqllock.ErrLost // told before anyone else acquires: not an overlap
	st.acquired(2, &fakeLease{tok: 6})
	st.released(1, lost)
	if st.overlaps != 0 || !st.tokensOK || st.losses != 1 || st.handoffs != 0 {
		t.Errorf("overlaps %d tokensOK %v losses %d handoffs %d\n%s", st.overlaps, st.tokensOK, st.losses, st.handoffs, out.String())
	}
}
