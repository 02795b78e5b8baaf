package sqllock_test

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/testdb"
)

// Environment of the replica processes of TestCampaignFailover.
const (
	replicaEnv      = "SQLLOCK_CAMPAIGN_REPLICA" // dialect
	replicaDSNEnv   = "SQLLOCK_CAMPAIGN_REPLICA_DSN"
	replicaAddrEnv  = "SQLLOCK_CAMPAIGN_REPLICA_ADDR" // the parent's proxy
	replicaNameEnv  = "SQLLOCK_CAMPAIGN_REPLICA_NAME"
	replicaStratEnv = "SQLLOCK_CAMPAIGN_REPLICA_STRATEGY"
)

// TestHelperCampaignReplica is a replica process of TestCampaignFailover: it
// campaigns for the lock with a short-timed Locker of the strategy, through the
// parent's proxy, and prints "START token unixnano" when a term starts and "END token
// unixnano cause" when its context ends (fn then returns nil). It stops when its
// stdin closes, and prints "EXIT" and Campaign's error. Without the replica
// environment it returns at once.
func TestHelperCampaignReplica(t *testing.T) {
	d, ok := testdb.ChildDialect(replicaEnv)
	if !ok {
		return
	}
	fail := func(err error) { fmt.Println("ERR", err); os.Exit(2) }
	db, err := testdb.OpenVia(d, os.Getenv(replicaDSNEnv), os.Getenv(replicaAddrEnv))
	if err != nil {
		fail(err)
	}
	var s strategy
	for _, c := range strategies {
		if c.name == os.Getenv(replicaStratEnv) {
			s = c
		}
	}
	if s.name == "" {
		fail(fmt.Errorf("unknown strategy %q", os.Getenv(replicaStratEnv)))
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	err = sqllock.Campaign(ctx, s.newShort(t, db, d), os.Getenv(replicaNameEnv), func(lctx context.Context) error {
		lease, _ := sqllock.LeaseFromContext(lctx)
		fmt.Printf("START %d %d\n", lease.Token(), time.Now().UnixNano())
		<-lctx.Done()
		fmt.Printf("END %d %d %v\n", lease.Token(), time.Now().UnixNano(), context.Cause(lctx))
		return nil
	}, sqllock.WithRetryDelay(100*time.Millisecond))
	fmt.Println("EXIT", err)
	if !errors.Is(err, context.Canceled) {
		os.Exit(1)
	}
	os.Exit(0)
}

// replica is a replica process seen from the test.
type replica struct {
	id    int
	cmd   *exec.Cmd
	stdin io.WriteCloser
	proxy *testdb.Proxy
	eof   chan struct{} // closed when its stdout ends
}

// event is a line of a replica.
type event struct {
	replica *replica
	kind    string // START, END, EXIT, ERR
	token   int64
	at      time.Time
	rest    string
}

// term is one leader's term: from START to END, or to the kill of its process.
type term struct {
	replica    *replica
	token      int64
	start, end time.Time
	ended      bool
}

// startReplica starts a replica process of strategy s whose connections go through
// a proxy of its own; its lines go to events.
func startReplica(t *testing.T, id int, d sqllock.Dialect, s, name string, events chan<- event) *replica {
	t.Helper()
	r := &replica{id: id, proxy: testdb.StartProxyTo(t, d), eof: make(chan struct{})}
	r.cmd = exec.Command(os.Args[0], "-test.run=^TestHelperCampaignReplica$", "-test.count=1")
	r.cmd.Env = append(os.Environ(), replicaEnv+"="+d.String(), replicaDSNEnv+"="+testdb.DSN(t, d),
		replicaAddrEnv+"="+r.proxy.Addr(), replicaNameEnv+"="+name, replicaStratEnv+"="+s)
	r.cmd.Stderr = os.Stderr
	var err error
	if r.stdin, err = r.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := r.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(r.eof)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			f := strings.SplitN(sc.Text(), " ", 4)
			ev := event{replica: r, kind: f[0], rest: sc.Text()}
			if len(f) >= 3 && (ev.kind == "START" || ev.kind == "END") {
				ev.token, _ = strconv.ParseInt(f[1], 10, 64)
				ns, _ := strconv.ParseInt(f[2], 10, 64)
				ev.at = time.Unix(0, ns)
			}
			events <- ev
		}
	}()
	t.Cleanup(func() {
		r.stdin.Close()
		r.cmd.Process.Kill()
		<-r.eof
		r.cmd.Wait()
	})
	return r
}

// TestCampaignFailover: three replica processes campaign for one name with every
// strategy, each through a proxy of its own.
//
//  1. The first leader is killed with SIGKILL: another replica leads within TTL +
//     margin of the kill, with a greater token.
//  2. That leader is partitioned from the database (nothing passes, nothing is
//     closed): its fn's context ends with ErrLost, and the last replica leads within
//     TTL + margin of the cut, with a greater token, after the partitioned leader's
//     context ended.
//  3. The network heals, and the last leader stops (its stdin closes): the healed
//     replica, which campaigned again, leads with a greater token.
//
// Over the whole run, by the processes' own records: at most one leader at any
// instant in token order (each term starts after the previous term's context ended,
// or after its process was killed), and for the strategies that record holders,
// Leader names the leading process and its token.
func TestCampaignFailover(t *testing.T) {
	const margin = 2 * time.Second
	forEachStrategy(t, func(t *testing.T, d sqllock.Dialect, s strategy) {
		ttl := 2 * time.Second
		if s.name == "forupdate" {
			ttl = 3 * time.Second
		}
		ctx := testdb.Context(t, 2*time.Minute)
		name := testdb.Name(t, s.name)
		events := make(chan event, 256)
		var rs []*replica
		for i := range 3 {
			rs = append(rs, startReplica(t, i, d, s.name, name, events))
		}
		observer := s.newShort(t, testdb.Open(t, d), d)

		var terms []*term
		current := map[*replica]*term{}
		// next consumes events until a term starts (and returns it) or, with until set,
		// until until reports true.
		next := func(what string, until func() bool) *term {
			t.Helper()
			for until == nil || !until() {
				var ev event
				select {
				case ev = <-events:
				case <-ctx.Done():
					t.Fatalf("waiting for %s: %v", what, ctx.Err())
				}
				switch ev.kind {
				case "START":
					tm := &term{replica: ev.replica, token: ev.token, start: ev.at}
					terms = append(terms, tm)
					current[ev.replica] = tm
					if until == nil {
						return tm
					}
				case "END":
					if tm := current[ev.replica]; tm != nil && tm.token == ev.token {
						tm.end, tm.ended = ev.at, true
						delete(current, ev.replica)
					}
					if strings.Contains(ev.rest, "lost") {
						t.Logf("replica %d: %s", ev.replica.id, ev.rest)
					}
				case "ERR":
					t.Fatalf("replica %d: %s", ev.replica.id, ev.rest)
				case "EXIT":
					if !strings.Contains(ev.rest, "context canceled") {
						t.Errorf("replica %d: %s", ev.replica.id, ev.rest)
					}
				}
			}
			return nil
		}
		// checkLeader: Leader names the leading process and its token.
		checkLeader := func(tm *term) {
			t.Helper()
			if !inspects(s.name) {
				return
			}
			h, err := sqllock.Leader(ctx, observer, name)
			if err != nil || h.PID != int64(tm.replica.cmd.Process.Pid) || h.Token != tm.token {
				t.Errorf("Leader = %+v, %v; want pid %d, token %d", h, err, tm.replica.cmd.Process.Pid, tm.token)
			}
		}

		first := next("the first leader", nil)
		checkLeader(first)

		// 1. SIGKILL of the leader.
		killed := time.Now()
		if err := first.replica.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		second := next("a leader after the kill", nil)
		if !first.ended {
			first.end, first.ended = killed, true // the process died at the latest here
		}
		if took := second.start.Sub(killed); took > ttl+margin {
			t.Errorf("new leader %v after the kill, want at most TTL %v + %v", took, ttl, margin)
		}
		checkLeader(second)
		t.Logf("SIGKILL: replica %d (token %d) replaced by replica %d (token %d) %v after the kill",
			first.replica.id, first.token, second.replica.id, second.token, second.start.Sub(killed).Round(time.Millisecond))

		// 2. Partition of the leader.
		cut := time.Now()
		second.replica.proxy.Partition()
		third := next("a leader after the partition", nil)
		next("the partitioned leader's END", func() bool { return second.ended })
		if took := third.start.Sub(cut); took > ttl+margin {
			t.Errorf("new leader %v after the partition, want at most TTL %v + %v", took, ttl, margin)
		}
		checkLeader(third)
		t.Logf("partition: replica %d (token %d, context ended %v after the cut) replaced by replica %d (token %d) %v after the cut",
			second.replica.id, second.token, second.end.Sub(cut).Round(time.Millisecond),
			third.replica.id, third.token, third.start.Sub(cut).Round(time.Millisecond))

		// 3. Heal, and stop the last leader: the healed replica leads again.
		second.replica.proxy.Heal()
		third.replica.stdin.Close()
		fourth := next("a leader after the heal", nil)
		if fourth.replica != second.replica {
			t.Errorf("replica %d leads after the heal, want the healed replica %d", fourth.replica.id, second.replica.id)
		}
		checkLeader(fourth)
		next("the last leader's END", func() bool { return third.ended })
		second.replica.stdin.Close()
		for _, r := range rs {
			select {
			case <-r.eof:
			case <-ctx.Done():
				t.Fatalf("replica %d did not stop", r.id)
			}
		}
		next("the last events", func() bool { return len(events) == 0 })

		// At most one leader at any instant, in token order: sorted by token, each
		// term starts after the one before it ended.
		slices.SortFunc(terms, func(a, b *term) int { return cmp.Compare(a.token, b.token) })
		for i, tm := range terms {
			if !tm.ended {
				t.Errorf("term of replica %d (token %d) never ended", tm.replica.id, tm.token)
				continue
			}
			if i == 0 {
				continue
			}
			prev := terms[i-1]
			if tm.token <= prev.token {
				t.Errorf("term %d: token %d after %d", i, tm.token, prev.token)
			}
			if !tm.start.After(prev.end) {
				t.Errorf("term %d (replica %d, token %d) started %v before term %d (replica %d, token %d) ended",
					i, tm.replica.id, tm.token, prev.end.Sub(tm.start), i-1, prev.replica.id, prev.token)
			}
		}
		if len(terms) != 4 {
			var b strings.Builder
			for _, tm := range terms {
				fmt.Fprintf(&b, " [replica %d token %d]", tm.replica.id, tm.token)
			}
			t.Errorf("%d terms, want 4:%s", len(terms), b.String())
		}
	})
}
