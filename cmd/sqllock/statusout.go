package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sqllock/sqllock"
)

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// watchFlag is --watch or --watch=INTERVAL.
type watchFlag struct{ every time.Duration }

func (w *watchFlag) String() string {
	if w == nil || w.every == 0 {
		return ""
	}
	return w.every.String()
}
func (w *watchFlag) IsBoolFlag() bool { return true }
func (w *watchFlag) Set(v string) error {
	switch v {
	case "true":
		w.every = 2 * time.Second
	case "false":
		w.every = 0
	default:
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return fmt.Errorf("--watch=%s: want a positive duration such as 2s", v)
		}
		w.every = d
	}
	return nil
}

// isTTY reports whether w is a terminal.
func isTTY(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func statusCmd(ctx context.Context, db *sql.DB, d sqllock.Dialect, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	asJSON := fs.Bool("json", false, "print one JSON document (a list of locks)")
	var watch watchFlag
	fs.Var(&watch, "watch", "refresh every interval (default 2s) until interrupted")
	var o statusOpts
	fs.Var((*stringList)(&o.names), "name", "a lock name to recognise advisory keys by (repeatable)")
	fs.StringVar(&o.namespace, "namespace", "", "the advisory Lockers' namespace (default: sqllock on PostgreSQL, the database on MySQL)")
	fs.Usage = func() { fmt.Fprintln(stderr, usage) }
	if err := fs.Parse(args); err != nil {
		return parseErr(err) // Parse printed the usage
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return errUsage
	}
	once := func() error {
		snap, err := collect(ctx, db, d, o)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(stdout, snap, stderr)
		}
		writeTable(stdout, snap)
		return nil
	}
	if watch.every == 0 {
		return once()
	}
	tty := isTTY(stdout)
	for first := true; ; first = false {
		if tty {
			fmt.Fprint(stdout, "\x1b[H\x1b[2J")
		} else if !first && !*asJSON {
			fmt.Fprintln(stdout, "---")
		}
		if !*asJSON {
			fmt.Fprintf(stdout, "%s  (every %v; Ctrl-C to stop)\n", time.Now().Format(time.RFC3339), watch.every)
		}
		if err := once(); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(watch.every):
		}
	}
}

func writeJSON(out io.Writer, snap *snapshot, stderr io.Writer) error {
	locks := snap.Locks
	if locks == nil {
		locks = []Lock{}
	}
	b, err := json.Marshal(locks)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(out, "%s\n", b); err != nil {
		return err
	}
	for _, n := range snap.Notes {
		fmt.Fprintln(stderr, "sqllock status: note:", n)
	}
	return nil
}

func writeTable(out io.Writer, snap *snapshot) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "STRATEGY\tNAME\tTOKEN\tHOLDER\tHELD\tLEFT\tWAITERS")
	now := time.Now()
	for _, l := range snap.Locks {
		name := "(unknown name " + l.Key + ")"
		if l.Name != nil {
			name = display(*l.Name)
		}
		tok, held, left := "-", "-", "-"
		if l.Token != nil {
			tok = strconv.FormatInt(*l.Token, 10)
		}
		if l.Since != nil {
			held = now.Sub(*l.Since).Round(time.Millisecond).String()
		}
		if l.ExpiresIn != nil {
			if *l.ExpiresIn <= 0 {
				left = "expired"
			} else {
				left = time.Duration(*l.ExpiresIn * float64(time.Second)).Round(time.Millisecond).String()
			}
		}
		holder := "-"
		if l.Holder != nil {
			holder = l.Holder.short()
		}
		ws := make([]string, len(l.Waiters))
		for i, p := range l.Waiters {
			ws[i] = p.short()
		}
		waiters := strconv.Itoa(len(l.Waiters))
		if len(ws) > 0 {
			waiters += ": " + strings.Join(ws, ", ")
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", l.Strategy, name, tok, holder, held, left, waiters)
	}
	w.Flush()
	fmt.Fprintf(out, "%d locks\n", len(snap.Locks))
	for _, l := range snap.Locks {
		// The notes every lock of a strategy has are in the JSON only.
		if l.Note != "" && !strings.HasPrefix(l.Note, "waiters") && !strings.HasPrefix(l.Note, "a semaphore") {
			n := "?"
			if l.Name != nil {
				n = display(*l.Name)
			}
			fmt.Fprintf(out, "  %s %s: %s\n", l.Strategy, n, l.Note)
		}
	}
	for _, n := range snap.Notes {
		fmt.Fprintln(out, "note:", n)
	}
}

// short describes a party in one word: host:pid for the row strategies, the server
// session otherwise.
func (p Party) short() string {
	var parts []string
	if p.Ticket != nil {
		parts = append(parts, "#"+strconv.FormatInt(*p.Ticket, 10))
	}
	if p.Host != nil && p.PID != nil && *p.PID != 0 {
		parts = append(parts, *p.Host+"/"+strconv.FormatInt(*p.PID, 10))
	} else if p.Host != nil && *p.Host != "" {
		parts = append(parts, *p.Host)
	}
	if p.Session != nil {
		parts = append(parts, "session "+strconv.FormatInt(*p.Session, 10))
	}
	if p.Application != nil && *p.Application != "" {
		parts = append(parts, "("+*p.Application+")")
	}
	return strings.Join(parts, " ")
}
