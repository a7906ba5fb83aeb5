package leases

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestEveryEtcdCallPassesTheGate keeps etcd's answers in view of the gate (etcdgate): the
// revision floor, reachability and "etcd went back" hold only for answers it sees. The agent
// is handed etcd's client by Start, which gives it to the gate alone and uses the gate's
// Client; no code of the agent makes a client of its own or reaches etcd's connection past
// it. The one exception is the keeper's pipelined renewal (RenewNow), whose answers reach the
// gate through OnHeard: the test fails if it stops passing them on.
func TestEveryEtcdCallPassesTheGate(t *testing.T) {
	fset := token.NewFileSet()
	var sawStart, sawRenew bool
	for _, src := range agentSource(t, fset, agentDirs(t)...) {
		name, f := src.name, src.f
		etcd := importName(f, "go.etcd.io/etcd/client/v3")
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			if fn.Name.Name == "Start" && fn.Recv == nil && name == "agent.go" {
				sawStart = true
				checkStart(t, fset, fn)
			}
			renew := fn.Name.Name == "RenewNow" && name == filepath.Join("keeper", "keeper.go")
			sawRenew = sawRenew || renew
			heard := false
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				sel, ok := n.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				switch x, _ := sel.X.(*ast.Ident); {
				case x != nil && etcd != "" && x.Name == etcd && strings.HasPrefix(sel.Sel.Name, "New"):
					t.Errorf("%s: %s.%s makes an etcd client past the gate; use the gate's Client",
						fset.Position(sel.Pos()), etcd, sel.Sel.Name)
				case sel.Sel.Name == "ActiveConnection" && !renew, sel.Sel.Name == "Maintenance", sel.Sel.Name == "MemberList":
					// The gate's Client sees KV, lease and watch answers; the rest of the
					// client is etcd's own.
					t.Errorf("%s: %s reaches etcd past the gate; use the gate's Client", fset.Position(sel.Pos()), sel.Sel.Name)
				case sel.Sel.Name == "onHeard":
					heard = true
				}
				return true
			})
			if renew && !heard {
				t.Errorf("%s: RenewNow reads keep-alive answers on etcd's connection without passing them to OnHeard (the gate)",
					fset.Position(fn.Pos()))
			}
		}
	}
	if !sawStart || !sawRenew {
		t.Errorf("Start in agent.go (found %v) or RenewNow in keeper/keeper.go (found %v) moved: update this test", sawStart, sawRenew)
	}
}

// checkStart fails t unless Start's etcd client (its parameter cli) is used once, handed to
// etcdgate.New.
func checkStart(t *testing.T, fset *token.FileSet, fn *ast.FuncDecl) {
	t.Helper()
	uses, toGate := 0, 0
	keys := map[*ast.Ident]bool{} // a struct literal's field names, which the parser may resolve to cli
	ast.Inspect(fn.Body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.KeyValueExpr:
			if id, ok := n.Key.(*ast.Ident); ok {
				keys[id] = true
			}
		case *ast.CallExpr:
			if sel, ok := n.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "New" {
				if x, ok := sel.X.(*ast.Ident); ok && x.Name == "etcdgate" && len(n.Args) > 1 {
					if id, ok := n.Args[1].(*ast.Ident); ok && id.Name == "cli" {
						toGate++
					}
				}
			}
		case *ast.Ident:
			if n.Name == "cli" && !keys[n] && n.Obj != nil && n.Obj.Kind == ast.Var && n.Obj.Decl != nil {
				if f, ok := n.Obj.Decl.(*ast.Field); ok && f.Pos() >= fn.Type.Params.Pos() && f.End() <= fn.Type.Params.End() {
					uses++
				}
			}
		}
		return true
	})
	if uses != 1 || toGate != 1 {
		t.Errorf("%s: Start uses its etcd client %d times, %d of them handed to etcdgate.New; the gate must be its only user",
			fset.Position(fn.Pos()), uses, toGate)
	}
}

// importName is the name f imports path under, or "" when it does not.
func importName(f *ast.File, path string) string {
	for _, imp := range f.Imports {
		if strings.Trim(imp.Path.Value, `"`) != path {
			continue
		}
		if imp.Name != nil {
			return imp.Name.Name
		}
		return "clientv3" // the package's name, not its path's last element

	}
	return ""
}

// sourceFile is a parsed Go file of the agent's code.
type sourceFile struct {
	name string
	f    *ast.File
}

// agentDirs are package leases and every part under it but the gate itself: a part cut out
// later is checked from the day it is.
func agentDirs(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	dirs := []string{"."}
	for _, e := range entries {
		if e.IsDir() && e.Name() != "etcdgate" && e.Name() != "testdata" {
			dirs = append(dirs, e.Name())
		}
	}
	if len(dirs) < 8 {
		t.Fatalf("found only %v under leases", dirs)
	}
	return dirs
}

// agentSource parses, with fset, the Go files but tests of dirs (relative to package leases).
func agentSource(t *testing.T, fset *token.FileSet, dirs ...string) []sourceFile {
	t.Helper()
	var out []sourceFile
	for _, dir := range dirs {
		names, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range names {
			if strings.HasSuffix(name, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, name, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, sourceFile{name, f})
		}
	}
	return out
}
