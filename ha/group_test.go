//go:build ha

package ha_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/internal/sqlerr"
	"github.com/sqllock/sqllock/testdb/ha"
)

// TestGroupReplication runs the hammer (see TestHammer) on a MySQL Group Replication
// group in multi-primary mode, one process on each member. GET_LOCK is local to a
// member (shown first: both members grant the same name at once), so advisory and
// forupdate must refuse the group (with WithGaleraSingleWriter, the promise that
// every client reaches one member, broken here on purpose, their overlaps are
// logged: the measurement of why they refuse). The row strategies' rows are
// certified group-wide at commit: no lost update, no overlap, and no error either (a
// certification conflict, error 3101, is waited out like a deadlock).
func TestGroupReplication(t *testing.T) {
	g := ha.StartMySQL(t)
	m1, m2 := openGroupMember(t, g, 1), openGroupMember(t, g, 2)
	ctx := ctxFor(t, time.Minute)

	// The reason for the refusals: each member grants a GET_LOCK of its own.
	name := "ha-gr-getlock"
	var got [2]int
	for i, db := range []*sql.DB{m1, m2} {
		c, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := c.QueryRowContext(ctx, "SELECT GET_LOCK(?, 0)", name).Scan(&got[i]); err != nil {
			t.Fatal(err)
		}
	}
	if got != [2]int{1, 1} {
		t.Fatalf("GET_LOCK(%q, 0) on members 1 and 2: %v; the lab's members should both grant it (member-local locks)", name, got)
	}
	// The reason advisory with tokens refuses every member: its MEMORY table takes no
	// writes in a group.
	if _, err := m1.ExecContext(ctx, "UPDATE sqllock_runs SET base = base"); !sqlerr.IsCode(err, "3098") {
		t.Fatalf("a write to the MEMORY table sqllock_runs on member 1: %v; want error 3098 (the group refuses non-InnoDB writes)", err)
	}

	cells := []hammerCell{
		{strategy: "uniqueindex", expect: "safe", clean: true},
		{strategy: "optimistic", expect: "safe", clean: true},
		{strategy: "fairqueue", expect: "safe", clean: true},
		{strategy: "forupdate", expect: "refused"},
		{strategy: "advisory", expect: "refused"},
		{strategy: "forupdate", optIn: true, expect: "measured"},
		// advisory's tokens live in a MEMORY table, which the group refuses: no
		// promise makes them work; without tokens the promise is accepted.
		{strategy: "advisory", optIn: true, expect: "refused"},
		{strategy: "advisory-notoken", optIn: true, expect: "measured"},
	}
	top := hammerTopology{name: "group-replication", driver: "mysql", dsn: [2]string{g.GroupDSN(1), g.GroupDSN(2)}, db: m1, dbNode: m2, cells: cells}
	var summary []string
	for _, c := range top.cells {
		t.Run(c.label(), func(t *testing.T) { summary = append(summary, runHammerCell(t, top, c, hammerDuration)) })
	}
	t.Logf("hammer on Group Replication:\n%s", strings.Join(summary, "\n"))
}

// TestGroupReplicationSinglePrimary switches the group to single-primary mode: there
// the primary is accepted by advisory and forupdate (clients that write all reach
// it) and the secondary refused; back in multi-primary mode both members are
// refused again. Each check is a new Locker (a Locker keeps its answer).
func TestGroupReplicationSinglePrimary(t *testing.T) {
	g := ha.StartMySQL(t)
	m1, m2 := openGroupMember(t, g, 1), openGroupMember(t, g, 2)
	ctx := ctxFor(t, 3*time.Minute)
	// A user that may not read performance_schema (where the member's state and role
	// are): the check must not let it through where it would let grlab through.
	if _, err := m1.ExecContext(ctx, "CREATE USER IF NOT EXISTS 'grplain'@'%' IDENTIFIED BY 'grplain'"); err != nil {
		t.Fatal(err)
	}
	if _, err := m1.ExecContext(ctx, "GRANT ALL ON locktest.* TO 'grplain'@'%'"); err != nil {
		t.Fatal(err)
	}
	plain := func(n int) *sql.DB {
		return ha.Open(t, "mysql", strings.Replace(g.GroupDSN(n), "grlab:grlab@", "grplain:grplain@", 1))
	}
	var denied error
	if err := plain(1).QueryRowContext(ctx, "SELECT COUNT(*) FROM performance_schema.replication_group_members").Scan(new(int)); err == nil {
		t.Fatal("grplain reads performance_schema.replication_group_members; the test wants a user that cannot")
	} else {
		denied = err
	}
	t.Logf("grplain: %v", denied)
	members := []*sql.DB{m1, m2, plain(1), plain(2)}
	check := func(t *testing.T, i int, strategy string, noToken bool) error {
		t.Helper()
		l := mustLocker(t, strategy, members[i], sqllock.MySQL, lockerOpts{noToken: noToken})
		lease, err := l.Acquire(ctx, "ha-gr-single/"+strategy)
		if err == nil {
			if rerr := lease.Release(context.WithoutCancel(ctx)); rerr != nil {
				t.Errorf("member %d, %s: Release: %v", i+1, strategy, rerr)
			}
		}
		return err
	}
	// The members' roles as member 1 sees them, once both are ONLINE in the mode.
	roles := func(single bool) (primary int) {
		t.Helper()
		want := "PRIMARY"
		for {
			var mode string
			rs := map[int]string{}
			err := m1.QueryRowContext(ctx, "SELECT @@group_replication_single_primary_mode").Scan(&mode)
			if err == nil {
				var rows *sql.Rows
				rows, err = m1.QueryContext(ctx, "SELECT MEMBER_PORT, MEMBER_ROLE FROM performance_schema.replication_group_members WHERE MEMBER_STATE = 'ONLINE'")
				for err == nil && rows.Next() {
					var port int
					var role string
					if err = rows.Scan(&port, &role); err == nil {
						rs[port-3320] = role
					}
				}
				if rows != nil {
					rows.Close()
				}
			}
			if err == nil && (mode == "1") == single && len(rs) == 2 {
				if !single {
					return 0
				}
				for n, r := range rs {
					if r == want {
						return n
					}
				}
			}
			select {
			case <-ctx.Done():
				t.Fatalf("group not settled in single=%v: mode %q, roles %v, err %v", single, mode, rs, err)
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	defer func() {
		// Leave the group as the other tests expect it: multi-primary.
		if _, err := m1.ExecContext(context.WithoutCancel(ctx), "SELECT group_replication_switch_to_multi_primary_mode()"); err != nil {
			t.Errorf("back to multi-primary mode: %v", err)
		}
		roles(false)
	}()
	if _, err := m1.ExecContext(ctx, "SELECT group_replication_switch_to_single_primary_mode(@@server_uuid)"); err != nil {
		t.Fatalf("to single-primary mode: %v", err)
	}
	primary := roles(true)
	if primary != 1 {
		t.Fatalf("member %d is the primary; want member 1 (named in the switch)", primary)
	}
	for _, c := range []struct {
		strategy string
		noToken  bool
	}{{"forupdate", false}, {"forupdate", true}, {"advisory", true}} {
		for i := range members { // 0, 2: the primary (grlab, grplain); 1, 3: the secondary
			err := check(t, i, c.strategy, c.noToken)
			if i%2 == 0 && err != nil {
				t.Errorf("single-primary, pool %d on the primary, %s (noToken %v): %v; want it accepted", i, c.strategy, c.noToken, err)
			}
			if i%2 == 1 && !isRefusal(err) {
				t.Errorf("single-primary, pool %d on the secondary, %s (noToken %v): %v; want a refusal (ErrUnsafeDeployment)", i, c.strategy, c.noToken, err)
			}
		}
	}
	// advisory's tokens live in a MEMORY table, whose writes the group refuses: a
	// refusal that names WithoutToken, on the primary too.
	for i := range members {
		if err := check(t, i, "advisory", false); !isRefusal(err) || !strings.Contains(err.Error(), "WithoutToken") {
			t.Errorf("single-primary, pool %d, advisory with tokens: %v; want a refusal naming WithoutToken", i, err)
		} else if i == 0 {
			t.Logf("advisory with tokens on the primary: %v", err)
		}
	}
	// forupdate's tokens on the primary: the group refuses the MEMORY table that marks
	// a server's run, so they are not protected across a crash. The Locker says so
	// once, and records no epoch for it: each would be used up for good.
	epochs := func() (n int) {
		t.Helper()
		if err := m1.QueryRowContext(ctx, "SELECT COUNT(*) FROM sqllock_epoch").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := epochs()
	for range 2 {
		warns := &asyncWarnings{match: "refuses the MEMORY table"}
		l := mustLocker(t, "forupdate", members[0], sqllock.MySQL, lockerOpts{logger: warns.logger()})
		lease, err := l.Acquire(ctx, "ha-gr-single/forupdate-epoch")
		if err != nil {
			t.Fatalf("forupdate with tokens on the primary: %v", err)
		}
		lease.Release(context.WithoutCancel(ctx))
		if warns.count() != 1 {
			t.Errorf("forupdate with tokens on the primary: %d warnings %q; want 1 (tokens not protected across a crash)", warns.count(), warns.messages())
		}
	}
	if after := epochs(); after != before {
		t.Errorf("forupdate on the primary recorded %d epochs; want none", after-before)
	}
	if _, err := m1.ExecContext(ctx, "SELECT group_replication_switch_to_multi_primary_mode()"); err != nil {
		t.Fatalf("back to multi-primary mode: %v", err)
	}
	roles(false)
	for i := range members {
		for _, strategy := range []string{"forupdate", "advisory"} {
			if err := check(t, i, strategy, true); !isRefusal(err) {
				t.Errorf("multi-primary, pool %d, %s: %v; want a refusal (ErrUnsafeDeployment)", i, strategy, err)
			}
		}
	}
}
