package integration

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// The extractor of TestDocCommands: which lines of a Markdown document are etcdctl and
// leaseholdctl commands to run, and what each is expected to do.
//
// A command is a line of a fenced code block that begins with `etcdctl ` or `leaseholdctl `
// at the block's margin, after a `$ ` prompt when the block uses prompts (its other lines are
// then output). It goes on over the next lines while a quote is open or a line ends in `\`,
// `|` or `&&`; in a prompted block a continuation line may begin with `> `. Other lines (other
// tools, comments, a command indented inside a loop) are not run. Comments (`#` at the start
// of a word, outside quotes) are kept in Text and left out of Code. A comment starting
// `# exit N` says the command exits N on the demo's state, as a refusal does; the default is 0.
//
// `<!-- doccheck: skip (REASON) -->` on the line right before a block's opening fence keeps
// its commands from running; REASON says why they cannot run on the demo's state. Keep such
// blocks few: TestDocCommands lists them.

// docCommand is one etcdctl or leaseholdctl command of a document.
type docCommand struct {
	// File and Line say where the command starts.
	File string
	Line int
	// Text is the command as the document shows it (without prompt), with its comments and
	// continuation lines.
	Text string
	// Code is Text without comments: what the shell runs.
	Code string
	// Exit is the exit status a `# exit N` comment declares, 0 without one.
	Exit int
}

// docBlock is a fenced code block with at least one command.
type docBlock struct {
	File string
	// Line is the line of the opening fence.
	Line int
	// Skip is the reason given by a doccheck skip marker, "" when the block runs.
	Skip     string
	Commands []docCommand
}

var (
	docMarkerRE  = regexp.MustCompile(`^\s*<!--\s*doccheck:\s*(.*?)\s*-->\s*$`)
	docSkipRE    = regexp.MustCompile(`^skip\s*\((.*)\)$`)
	docFenceRE   = regexp.MustCompile("^(\\s*)(`{3,}|~{3,})")
	docToolRE    = regexp.MustCompile(`^(etcdctl|leaseholdctl)(\s|$)`)
	docExitRE    = regexp.MustCompile(`^#\s*exit\s+(\d+)\b`)
	docMarkerFix = "the marker is <!-- doccheck: skip (WHY THE BLOCK CANNOT RUN ON THE DEMO'S STATE) --> on the line right before the block's opening fence"
)

// extractDocCommands returns the blocks of a Markdown document (named file in positions)
// that hold commands, and the problems of its doccheck markers: a marker without a reason, of
// an unknown kind, not right before a fence, or on a block without commands.
func extractDocCommands(file, text string) ([]docBlock, []error) {
	lines := strings.Split(text, "\n")
	var blocks []docBlock
	var errs []error
	skip, skipLine := "", 0
	for i := 0; i < len(lines); i++ {
		if m := docMarkerRE.FindStringSubmatch(lines[i]); m != nil {
			s := docSkipRE.FindStringSubmatch(m[1])
			switch {
			case s == nil && !strings.HasPrefix(m[1], "skip"):
				errs = append(errs, fmt.Errorf("%s:%d: unknown doccheck marker %q: %s", file, i+1, m[1], docMarkerFix))
			case s == nil || strings.TrimSpace(s[1]) == "":
				errs = append(errs, fmt.Errorf("%s:%d: doccheck skip marker without a reason: %s", file, i+1, docMarkerFix))
			case i+1 == len(lines) || !docFenceRE.MatchString(lines[i+1]):
				errs = append(errs, fmt.Errorf("%s:%d: doccheck marker not followed by a fence: %s", file, i+1, docMarkerFix))
			default:
				skip, skipLine = strings.TrimSpace(s[1]), i+1
			}
			continue
		}
		m := docFenceRE.FindStringSubmatch(lines[i])
		if m == nil {
			continue
		}
		indent, fence, open := len(m[1]), m[2], i
		var body []string
		for i++; i < len(lines) && !closesFence(lines[i], fence); i++ {
			l := lines[i]
			body = append(body, l[min(indent, len(l)-len(strings.TrimLeft(l, " "))):])
		}
		b := docBlock{File: file, Line: open + 1, Skip: skip, Commands: blockCommands(file, open+2, body)}
		if skip != "" && len(b.Commands) == 0 {
			errs = append(errs, fmt.Errorf("%s:%d: doccheck skip marker on a block with no etcdctl or leaseholdctl command: remove it", file, skipLine))
		}
		if len(b.Commands) > 0 {
			blocks = append(blocks, b)
		}
		skip = ""
	}
	return blocks, errs
}

// closesFence says whether line closes a block opened by fence: the same character, at
// least as many, nothing else but spaces.
func closesFence(line, fence string) bool {
	t := strings.TrimSpace(line)
	return len(t) >= len(fence) && strings.Trim(t, fence[:1]) == ""
}

// blockCommands returns the commands of a block's body, whose first line is line first of file.
func blockCommands(file string, first int, body []string) []docCommand {
	prompted := false
	for _, l := range body {
		prompted = prompted || strings.HasPrefix(l, "$ ")
	}
	var cmds []docCommand
	for j := 0; j < len(body); j++ {
		l := body[j]
		if prompted {
			var ok bool
			if l, ok = strings.CutPrefix(l, "$ "); !ok {
				continue
			}
		}
		if !docToolRE.MatchString(l) {
			continue
		}
		c := docCommand{File: file, Line: first + j}
		var text, code []string
		var sc shellScanner
		for {
			text = append(text, l)
			part, comment := sc.line(l)
			code = append(code, part)
			if m := docExitRE.FindStringSubmatch(comment); m != nil {
				c.Exit, _ = strconv.Atoi(m[1])
			}
			if !sc.continues(part) || j+1 == len(body) {
				break
			}
			j++
			l = body[j]
			if prompted {
				l = strings.TrimPrefix(l, "> ")
			}
		}
		c.Text, c.Code = strings.Join(text, "\n"), strings.TrimSpace(strings.Join(code, "\n"))
		cmds = append(cmds, c)
	}
	return cmds
}

// shellScanner follows the quoting of a shell command line by line, as far as telling code
// from comments and a complete command from one that goes on.
type shellScanner struct {
	quote   byte // the open quote, or 0
	escaped bool // the last line ended in a backslash outside single quotes
}

// line returns the code of the next line of the command and its comment ("" without one).
func (s *shellScanner) line(l string) (code, comment string) {
	s.escaped = false
	for i := 0; i < len(l); i++ {
		c := l[i]
		switch {
		case s.quote == '\'':
			if c == '\'' {
				s.quote = 0
			}
		case c == '\\':
			if i == len(l)-1 {
				s.escaped = true
			}
			i++
		case s.quote == '"':
			if c == '"' {
				s.quote = 0
			}
		case c == '\'' || c == '"':
			s.quote = c
		case c == '#' && (i == 0 || strings.IndexByte(" \t;&|(", l[i-1]) >= 0):
			return strings.TrimRight(l[:i], " \t"), l[i:]
		}
	}
	return l, ""
}

// continues says whether the command goes on at the next line, given the code of its last.
func (s *shellScanner) continues(code string) bool {
	t := strings.TrimRight(code, " \t")
	return s.quote != 0 || s.escaped || strings.HasSuffix(t, "|") || strings.HasSuffix(t, "&&")
}

func TestExtractDocCommands(t *testing.T) {
	const sample = "# A doc\n" + // line 1
		"leaseholdctl pool list       (prose, not in a fence: not run)\n" +
		"```sh\n" +
		"leaseholdctl pool list                 # a comment\n" + // 4
		"etcdctl get --prefix /leasehold/v1/ips/net1/ \\\n" + // 5
		"  --keys-only   # continued\n" +
		"kubectl get pods                       # another tool: not run\n" +
		"leaseholdctl alloc release 10.10.9.66 --pool net1   # exit 1: refused while the lease lives\n" + // 8
		"etcdctl get --prefix /leasehold/v1/ -w json | jq -r '.kvs[]\n" + // 9
		"  | .key' |\n" +
		"  while read -r k; do echo ${k##*/} \"#$k\"; done\n" +
		"  leaseholdctl doctor                  # indented: inside something else, not run\n" +
		"```\n" +
		"<!-- doccheck: skip (needs a second etcd cluster) -->\n" + // 14
		"~~~\n" +
		"etcdctl --cert a.crt put /x 'y # not a comment'\n" + // 16
		"~~~\n" +
		"1. In a list:\n" +
		"   ```console\n" + // 19
		"   $ leaseholdctl node list\n" + // 20
		"   CLUSTER  NODE\n" +
		"   leaseholdctl output that looks like a command\n" +
		"   $ etcdctl get --prefix /leasehold/v1/pools/ |\n" + // 23
		"   > wc -l\n" +
		"   ```\n" +
		"<!-- doccheck: skip () -->\n" + // 26
		"```\n" +
		"leaseholdctl doctor\n" +
		"```\n" +
		"<!-- doccheck: skip -->\n" + // 30
		"<!-- doccheck: skip (no fence follows) -->\n" + // 31
		"<!-- doccheck: later -->\n" +
		"<!-- doccheck: skip (no command in it) -->\n" + // 33
		"```json\n" +
		"{}\n" +
		"```\n"
	blocks, errs := extractDocCommands("doc.md", sample)
	type cmd struct {
		line int
		code string
		exit int
	}
	want := []struct {
		line int
		skip string
		cmds []cmd
	}{
		// Comments are left out of the code; continuations by backslash, by pipe and by an open
		// quote are joined; a `# exit N` comment sets the expected status; `#` inside ${...} is
		// no comment; indented lines (inside a loop, say) and other tools are not commands.
		{3, "", []cmd{
			{4, "leaseholdctl pool list", 0},
			{5, "etcdctl get --prefix /leasehold/v1/ips/net1/ \\\n  --keys-only", 0},
			{8, "leaseholdctl alloc release 10.10.9.66 --pool net1", 1},
			{9, "etcdctl get --prefix /leasehold/v1/ -w json | jq -r '.kvs[]\n  | .key' |\n  while read -r k; do echo ${k##*/} \"#$k\"; done", 0},
		}},
		// A marked block keeps its reason; `#` inside quotes is no comment.
		{15, "needs a second etcd cluster", []cmd{{16, "etcdctl --cert a.crt put /x 'y # not a comment'", 0}}},
		// A prompted block inside a list: only prompt lines run, a `> ` line continues one.
		{19, "", []cmd{{20, "leaseholdctl node list", 0}, {23, "etcdctl get --prefix /leasehold/v1/pools/ |\nwc -l", 0}}},
		// The block after a marker without reason runs.
		{27, "", []cmd{{28, "leaseholdctl doctor", 0}}},
	}
	if len(blocks) != len(want) {
		t.Fatalf("got %d blocks, want %d: %+v", len(blocks), len(want), blocks)
	}
	for i, w := range want {
		b := blocks[i]
		if b.File != "doc.md" || b.Line != w.line || b.Skip != w.skip || len(b.Commands) != len(w.cmds) {
			t.Errorf("block %d: got line %d skip %q with %d commands, want line %d skip %q with %d", i, b.Line, b.Skip, len(b.Commands), w.line, w.skip, len(w.cmds))
			continue
		}
		for j, wc := range w.cmds {
			c := b.Commands[j]
			if c.Line != wc.line || c.Code != wc.code || c.Exit != wc.exit {
				t.Errorf("block %d command %d: got line %d exit %d code\n%s\nwant line %d exit %d code\n%s", i, j, c.Line, c.Exit, c.Code, wc.line, wc.exit, wc.code)
			}
		}
	}
	wantErrs := []string{
		"doc.md:26: doccheck skip marker without a reason",
		"doc.md:30: doccheck skip marker without a reason",
		"doc.md:31: doccheck marker not followed by a fence",
		"doc.md:32: unknown doccheck marker \"later\"",
		"doc.md:33: doccheck skip marker on a block with no etcdctl or leaseholdctl command",
	}
	if len(errs) != len(wantErrs) {
		t.Fatalf("got problems %q, want %d", errs, len(wantErrs))
	}
	for i, w := range wantErrs {
		if !strings.HasPrefix(errs[i].Error(), w) {
			t.Errorf("problem %d: got %q, want it to begin %q", i, errs[i], w)
		}
	}
}
