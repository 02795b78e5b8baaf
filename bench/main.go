// Command bench compares the lock strategies of sqllock with hand-written SQL, the
// SELECT 1 floor and the peer libraries, on PostgreSQL and
// MySQL/MariaDB, and prints the results as markdown tables:
//
//	cd bench && go run . -postgres "$PG_DSN" -mysql "$MY_DSN" -duration 5s -rounds 3 > results.md
//
// Every client is an independent replica: a *sql.DB of its own and a Locker (or
// hand-written state) of its own. For each dialect, cell and round it runs three
// phases of -duration each: one client taking and releasing its own name
// (uncontended), one client holding its own name -hold each time, and -clients clients
// on one name, each holding it -hold. Statements are round trips counted on the wire
// (see wire.go). Ratios are taken within a round; the tables show medians over rounds.
//
// A fresh database (-db, dropped and re-created) is migrated with the library's
// migrations and dropped at the end.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sqllock/sqllock"
	"github.com/sqllock/sqllock/migrations"
)

// config is the command line.
type config struct {
	pgDSN, myDSN string
	dbName       string
	dur, hold    time.Duration
	rounds       int
	clients      int
	distinct     int
	cells        *regexp.Regexp
	jsonPath     string
}

func main() {
	var c config
	var cells string
	flag.StringVar(&c.pgDSN, "postgres", "", "PostgreSQL DSN (pgx form, e.g. postgres://postgres@127.0.0.1:5432/test?sslmode=disable); empty: skip")
	flag.StringVar(&c.myDSN, "mysql", "", "MySQL/MariaDB DSN (go-sql-driver form, e.g. root@tcp(127.0.0.1:3306)/test); empty: skip")
	flag.StringVar(&c.dbName, "db", "sqllock_bench", "database created (dropped first if it exists) and dropped at the end")
	flag.DurationVar(&c.dur, "duration", 5*time.Second, "length of each phase of each cell")
	flag.IntVar(&c.rounds, "rounds", 3, "rounds; every cell runs once per round, ratios are taken within a round")
	flag.IntVar(&c.clients, "clients", 8, "independent clients in the contended phase")
	flag.IntVar(&c.distinct, "distinct", 32, "independent clients in the distinct-names phase (0: skip it)")
	flag.DurationVar(&c.hold, "hold", 100*time.Microsecond, "busy-spin while holding the lock in the contended phases")
	flag.DurationVar(&rawPoll, "poll", rawPoll, "retry interval of the hand-written polling cells (raw uniqueindex, raw optimistic)")
	flag.StringVar(&cells, "cells", "", "regexp: run only the cells whose name matches (the floor and raw cells are needed for ratios)")
	flag.StringVar(&c.jsonPath, "json", "", "also write the results as JSON to this file")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file (go tool pprof)")
	flag.Parse()
	if c.pgDSN == "" && c.myDSN == "" {
		fmt.Fprintln(os.Stderr, "bench: give -postgres, -mysql or both")
		flag.Usage()
		os.Exit(2)
	}
	if !regexp.MustCompile(`^[a-z][a-z0-9_]*$`).MatchString(c.dbName) {
		fatal(fmt.Errorf("-db %q: letters, digits and _ only", c.dbName))
	}
	var err error
	if c.cells, err = regexp.Compile(cells); err != nil {
		fatal(err)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fatal(err)
		}
		defer f.Close()
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, c, os.Stdout); err != nil {
		fatal(err)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(1)
}

// report is the JSON output.
type report struct {
	Command   string          `json:"command"`
	Date      time.Time       `json:"date"`
	GoVersion string          `json:"go_version"`
	NumCPU    int             `json:"nproc"`
	CPU       string          `json:"cpu"`
	Duration  string          `json:"phase_duration"`
	Rounds    int             `json:"rounds"`
	Clients   int             `json:"clients"`
	Distinct  int             `json:"distinct_clients"`
	Hold      string          `json:"hold"`
	Dialects  []dialectReport `json:"dialects"`
}

type dialectReport struct {
	Dialect string       `json:"dialect"`
	Server  string       `json:"server"`
	Cells   []cellReport `json:"cells"`
}

type cellReport struct {
	Name   string    `json:"name"`
	Raw    string    `json:"raw,omitempty"`
	Peer   string    `json:"peer,omitempty"`
	Median metrics   `json:"median"`
	Rounds []metrics `json:"rounds"`
	Errors []string  `json:"errors,omitempty"`
}

func run(ctx context.Context, c config, out io.Writer) error {
	rep := report{
		Command: commandLine(), Date: time.Now().UTC().Truncate(time.Second), GoVersion: runtime.Version(),
		NumCPU: runtime.NumCPU(), CPU: cpuModel(), Duration: c.dur.String(), Rounds: c.rounds,
		Clients: c.clients, Distinct: c.distinct, Hold: c.hold.String(),
	}
	var targets []*target
	for _, x := range []struct {
		d   sqllock.Dialect
		dsn string
	}{{sqllock.Postgres, c.pgDSN}, {sqllock.MySQL, c.myDSN}} {
		if x.dsn == "" {
			continue
		}
		t, err := setUp(ctx, x.d, x.dsn, c.dbName)
		if err != nil {
			return err
		}
		defer t.tearDown()
		targets = append(targets, t)
	}
	for _, t := range targets {
		dr, err := runDialect(ctx, c, t)
		if err != nil {
			return err
		}
		rep.Dialects = append(rep.Dialects, dr)
	}
	writeMarkdown(out, rep)
	if c.jsonPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		return os.WriteFile(c.jsonPath, append(b, '\n'), 0o644)
	}
	return nil
}

// runDialect runs every cell of t's dialect for c.rounds rounds. Cells run in turn,
// starting one further in the list each round.
func runDialect(ctx context.Context, c config, t *target) (dialectReport, error) {
	var cells []cell
	for _, cl := range cellsFor(t.d) {
		if cl.floor || strings.HasPrefix(cl.name, "raw ") || c.cells.MatchString(cl.name) {
			cells = append(cells, cl)
		}
	}
	perCell := map[string][]metrics{}
	errs := map[string][]string{}
	for r := range c.rounds {
		round := map[string]metrics{}
		for i := range cells {
			cl := cells[(i+r)%len(cells)]
			fmt.Fprintf(os.Stderr, "bench: %v round %d/%d: %s\n", t.d, r+1, c.rounds, cl.name)
			m := metrics{}
			phases := []struct {
				kind string
				ph   phase
				f    func(phaseResult)
			}{
				{"uncontended", phase{clients: 1, dur: c.dur}, m.uncontended},
				{"contended1", phase{clients: 1, hold: c.hold, dur: c.dur}, m.contended1},
				{"contended", phase{clients: c.clients, hold: c.hold, dur: c.dur}, m.contended},
			}
			if c.distinct > 0 {
				phases = append(phases, struct {
					kind string
					ph   phase
					f    func(phaseResult)
				}{"distinct", phase{clients: c.distinct, dur: c.dur, distinct: true}, m.distinct})
			}
			if cl.floor {
				phases = phases[:1]
			}
			for _, p := range phases {
				name := fmt.Sprintf("bench/%s/%s/r%d/%d", cl.name, p.kind, r, time.Now().UnixNano())
				for i := range max(1, p.ph.clients) {
					if err := ensureRow(ctx, t.setup, t.d, p.ph.clientName(name, i)); err != nil {
						return dialectReport{}, err
					}
				}
				res, err := p.ph.run(ctx, t, cl, name)
				if ctx.Err() != nil {
					return dialectReport{}, ctx.Err()
				}
				if err != nil { // the cell could not start: report it, go on with the others
					res.errs = append(res.errs, err)
				}
				for _, e := range res.errs {
					msg := fmt.Sprintf("round %d %s: %v", r+1, p.kind, e)
					fmt.Fprintln(os.Stderr, "bench:", cl.name, msg)
					errs[cl.name] = append(errs[cl.name], msg)
				}
				if err != nil {
					m[mErrors]++
					break
				}
				p.f(res)
			}
			if cl.raw != "" && !cl.isPeer && c.dur > 0 && m[mErrors] == 0 {
				if err := pairedRatios(ctx, t, cl, cells, m, fmt.Sprintf("bench/%s/paired/r%d/%d", cl.name, r, time.Now().UnixNano()), c.dur); err != nil {
					if ctx.Err() != nil {
						return dialectReport{}, ctx.Err()
					}
					msg := fmt.Sprintf("round %d paired: %v", r+1, err)
					fmt.Fprintln(os.Stderr, "bench:", cl.name, msg)
					errs[cl.name] = append(errs[cl.name], msg)
					m[mErrors]++
				}
			}
			round[cl.name] = m
		}
		ratios(cells, round)
		for name, m := range round {
			perCell[name] = append(perCell[name], m)
		}
	}
	dr := dialectReport{Dialect: t.d.String(), Server: t.version}
	for _, cl := range cells {
		dr.Cells = append(dr.Cells, cellReport{
			Name: cl.name, Raw: cl.raw, Peer: cl.peer,
			Median: median(perCell[cl.name]), Rounds: perCell[cl.name], Errors: errs[cl.name],
		})
	}
	return dr, nil
}

// pairedRatios runs cl in turns with its raw cell and, if it is in the run, its peer
// (see paired), each for dur, and records the ratios in m.
func pairedRatios(ctx context.Context, t *target, cl cell, cells []cell, m metrics, name string, dur time.Duration) error {
	find := func(name string) int { return slices.IndexFunc(cells, func(c cell) bool { return c.name == name }) }
	i := find(cl.raw)
	if i < 0 {
		return fmt.Errorf("raw cell %q is not in the run", cl.raw)
	}
	cs := []cell{cl, cells[i]}
	if j := find(cl.peer); cl.peer != "" && j >= 0 {
		cs = append(cs, cells[j])
	}
	run, err := paired(ctx, t, cs, name, dur)
	if err != nil {
		return err
	}
	m[mXRawPaired] = run.ratio(0, 1)
	if lo, hi, ok := run.interval(0, 1); ok {
		m[mXRawLo], m[mXRawHi] = lo, hi
	}
	if len(cs) > 2 {
		m[mXPeerPaired] = run.ratio(0, 2)
		if lo, hi, ok := run.interval(0, 2); ok {
			m[mXPeerLo], m[mXPeerHi] = lo, hi
		}
	}
	return nil
}

// target is one server, with the bench database created and migrated.
type target struct {
	d       sqllock.Dialect
	version string
	pg      *pgx.ConnConfig // PostgreSQL: connects to the bench database
	my      *mysql.Config   // MySQL: connects to the bench database
	setup   *sql.DB         // uncounted pool for set-up and rows
	admin   *sql.DB         // the DSN's own database, to drop the bench database
	dropSQL string
}

// open returns a new pool to the bench database whose connections count into wc.
// TLS is off: the counting parser must see plain protocol bytes.
func (t *target) open(wc *wireCount) (*sql.DB, error) {
	if t.d == sqllock.Postgres {
		cfg := t.pg.Copy()
		cfg.TLSConfig, cfg.Fallbacks = nil, nil
		cfg.DialFunc = countingDialer(wc, func() parser { return &pgParser{} })
		return stdlib.OpenDB(*cfg), nil
	}
	cfg := t.my.Clone()
	cfg.TLS, cfg.TLSConfig = nil, "false"
	cfg.DialFunc = countingDialer(wc, func() parser { return &myParser{} })
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	return sql.OpenDB(conn), nil
}

// setUp creates the database name on the server of dsn (dropping it first), applies
// the library's migrations and creates the raw tables.
func setUp(ctx context.Context, d sqllock.Dialect, dsn, name string) (*target, error) {
	t := &target{d: d}
	var create string
	if d == sqllock.Postgres {
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			return nil, fmt.Errorf("-postgres: %w", err)
		}
		t.admin = stdlib.OpenDB(*cfg)
		t.pg = cfg.Copy()
		t.pg.Database = name
		t.setup = stdlib.OpenDB(*t.pg)
		create, t.dropSQL = "CREATE DATABASE "+name, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"
	} else {
		cfg, err := mysql.ParseDSN(dsn)
		if err != nil {
			return nil, fmt.Errorf("-mysql: %w", err)
		}
		if t.admin, err = sql.Open("mysql", dsn); err != nil {
			return nil, err
		}
		t.my = cfg.Clone()
		t.my.DBName = name
		if t.setup, err = sql.Open("mysql", t.my.FormatDSN()); err != nil {
			return nil, err
		}
		create, t.dropSQL = "CREATE DATABASE "+name, "DROP DATABASE IF EXISTS "+name
	}
	err := func() error {
		if err := t.admin.QueryRowContext(ctx, "SELECT version()").Scan(&t.version); err != nil {
			return err
		}
		for _, q := range []string{t.dropSQL, create} {
			if _, err := t.admin.ExecContext(ctx, q); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		if err := migrations.Up(ctx, t.setup, d); err != nil {
			return err
		}
		for _, q := range rawTables(d) {
			if _, err := t.setup.ExecContext(ctx, q); err != nil {
				return fmt.Errorf("%s: %w", q, err)
			}
		}
		return nil
	}()
	if err != nil {
		t.tearDown()
		return nil, fmt.Errorf("%v: setting up database %s: %w", d, name, err)
	}
	return t, nil
}

// tearDown drops the bench database.
func (t *target) tearDown() {
	t.setup.Close()
	if t.dropSQL != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := t.admin.ExecContext(ctx, t.dropSQL); err != nil {
			fmt.Fprintf(os.Stderr, "bench: %s: %v\n", t.dropSQL, err)
		}
	}
	t.admin.Close()
}

// commandLine returns how the program was run, with the DSNs' passwords removed.
func commandLine() string {
	args := []string{"go run ."}
	flag.Visit(func(f *flag.Flag) {
		v := f.Value.String()
		switch f.Name {
		case "postgres", "mysql":
			v = redact(f.Name, v)
		}
		args = append(args, fmt.Sprintf("-%s %s", f.Name, shellQuote(v)))
	})
	return strings.Join(args, " ")
}

func redact(kind, dsn string) string {
	if kind == "postgres" {
		if cfg, err := pgx.ParseConfig(dsn); err == nil && cfg.Password != "" {
			return strings.Replace(dsn, cfg.Password, "xxx", 1)
		}
		return dsn
	}
	if cfg, err := mysql.ParseDSN(dsn); err == nil && cfg.Passwd != "" {
		return strings.Replace(dsn, ":"+cfg.Passwd+"@", ":xxx@", 1)
	}
	return dsn
}

func shellQuote(s string) string {
	if regexp.MustCompile(`^[A-Za-z0-9_./:@%+=,-]+$`).MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// cpuModel returns the "model name" of /proc/cpuinfo, or "unknown".
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

// writeMarkdown prints the header and one table per dialect.
func writeMarkdown(w io.Writer, rep report) {
	fmt.Fprintf(w, "# sqllock benchmark\n\n")
	fmt.Fprintf(w, "- Command: `cd bench && %s`\n", rep.Command)
	fmt.Fprintf(w, "- Date: %s; %s; nproc %d; CPU: %s\n", rep.Date.Format(time.RFC3339), rep.GoVersion, rep.NumCPU, rep.CPU)
	for _, d := range rep.Dialects {
		fmt.Fprintf(w, "- %s server: %s\n", d.Dialect, d.Server)
	}
	fmt.Fprintf(w, "- Each phase runs %s; %d round(s), medians over rounds, ratios taken within a round. "+
		"Contended: %d independent clients (a pool and a Locker each) on one name, each holding it %s (busy-spin).\n",
		rep.Duration, rep.Rounds, rep.Clients, rep.Hold)
	for _, d := range rep.Dialects {
		fmt.Fprintf(w, "\n## %s\n\n", d.Dialect)
		cols := []struct {
			title, key string
			f          func(float64) string
		}{
			{"uncontended pairs/s", mPairs, fInt},
			{"x raw", mXRaw, fX},
			{"x floor", mXFloor, fX},
			{"x peer", mXPeer, fX},
			{"x raw paired", mXRawPaired, fX},
			{"x peer paired", mXPeerPaired, fX},
			{"stmts/acq", mStmtsUnc, fF2},
			{"1 client acq/s", mC1, fInt},
			{fmt.Sprintf("%d clients acq/s", rep.Clients), mCN, fInt},
			{fmt.Sprintf("%d clients x raw", rep.Clients), mCNXRaw, fX},
			{fmt.Sprintf("%d clients stmts/acq", rep.Clients), mStmtsCN, fF2},
			{"min share", mMinShare, func(v float64) string { return fmt.Sprintf("%.1f %%", v) }},
			{"wait p50", mWaitP50, fUs},
			{"wait p99", mWaitP99, fUs},
			{"hand-off p50", mHandoffP50, fUs},
			{"hand-off p99", mHandoffP99, fUs},
			{fmt.Sprintf("%d distinct acq/s", rep.Distinct), mDist, fInt},
			{fmt.Sprintf("%d distinct x raw", rep.Distinct), mDistXRaw, fX},
			{fmt.Sprintf("%d clients NOTIFY/acq", rep.Clients), mNotifyCN, fF2},
			{fmt.Sprintf("%d distinct NOTIFY/acq", rep.Distinct), mNotifyDist, fF2},
		}
		// Columns no cell of this dialect measured (peers, notifications) are left out.
		cols = slices.DeleteFunc(cols, func(c struct {
			title, key string
			f          func(float64) string
		}) bool {
			for _, cell := range d.Cells {
				if _, ok := cell.Median[c.key]; ok {
					return false
				}
			}
			return true
		})
		fmt.Fprint(w, "| cell |")
		for _, c := range cols {
			fmt.Fprintf(w, " %s |", c.title)
		}
		fmt.Fprint(w, "\n|---|")
		for range cols {
			fmt.Fprint(w, "---:|")
		}
		fmt.Fprintln(w)
		var notes []string
		for _, c := range d.Cells {
			fmt.Fprintf(w, "| %s |", c.Name)
			for _, col := range cols {
				if v, ok := c.Median[col.key]; ok {
					fmt.Fprintf(w, " %s%s |", col.f(v), c.Median.interval(col.key))
				} else {
					fmt.Fprint(w, " - |")
				}
			}
			fmt.Fprintln(w)
			if len(c.Errors) > 0 {
				notes = append(notes, fmt.Sprintf("- %s: %d error(s), first: %s", c.Name, len(c.Errors), c.Errors[0]))
			}
		}
		if len(notes) > 0 {
			fmt.Fprintf(w, "\nErrors:\n%s\n", strings.Join(notes, "\n"))
		}
	}
	fmt.Fprint(w, `
Columns: *uncontended pairs/s*: Acquire+Release of a name of its own by one client.
*x raw*: that over the hand-written SQL of the same strategy in the same round (fairqueue
is compared with raw INSERT/DELETE); *x floor*: over the floor, two SELECT 1 round trips.
*x raw paired*, *x peer paired*: the same ratios from a run of their own in which one
client of the cell and one of the raw cell (and of the peer) take turns of 100 ms, for
the phase time each: both see the same moments of the machine, so these ratios vary
less between rounds than those of phases run apart.
In brackets after a paired ratio: its 90 % bootstrap interval over the run's cycles of
turns (medians over rounds, like the ratio): how much the machine's noise within a run
moves it; a target inside the interval is neither met nor missed by that run.
*stmts/acq*: round trips per acquisition counted on the wire, keep-alives and listeners
included (MySQL commands without a reply, such as COM_STMT_CLOSE, are in the JSON as
oneway). *1 client acq/s*: one client holding its own name for the hold time each time.
Contended columns: all clients on one name. *min share*: the smallest client's share of
the acquisitions (100/clients % is fair). *wait*: Acquire call to return. *hand-off*:
the previous holder's Release returning to the next holder's Acquire returning, for
acquisitions that were waiting when that Release returned. *distinct*: that many
clients at once, each on a name of its own (no contention: what the statements cost when
many run at once; on PostgreSQL a NOTIFY would serialise their commits). *NOTIFY/acq*
(PostgreSQL): notifications sent on the library's channels per acquisition, counted by a
LISTEN session of the bench's; *raw uniqueindex NOTIFY* is raw uniqueindex whose every
release also notifies, and its *x raw* columns are what a NOTIFY per release costs.
`)
}

func fInt(v float64) string { return fmt.Sprintf("%.0f", v) }
func fX(v float64) string   { return fmt.Sprintf("%.2fx", v) }
func fF2(v float64) string  { return fmt.Sprintf("%.2f", v) }

// interval returns " [lo-hi]", the bootstrap interval recorded for the paired ratio
// key, or "" for other keys and ratios without one.
func (m metrics) interval(key string) string {
	lo, hi := mXRawLo, mXRawHi
	switch key {
	case mXRawPaired:
	case mXPeerPaired:
		lo, hi = mXPeerLo, mXPeerHi
	default:
		return ""
	}
	l, okl := m[lo]
	h, okh := m[hi]
	if !okl || !okh {
		return ""
	}
	return fmt.Sprintf(" [%.2f-%.2f]", l, h)
}

// fUs formats microseconds.
func fUs(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2f s", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.1f ms", v/1e3)
	}
	return fmt.Sprintf("%.0f µs", v)
}
