package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
)

// specField is one key of a job spec file.
type specField struct {
	Key  string // the path of the key: source.cursor, document.fields[].name
	Type string // string, integer, number, boolean, duration, list of …, object
	Doc  string // the field's doc comment, as one line
}

// specFields reads the job spec's keys from the Go declaration of
// batch.Spec (batch/*.go): every field with a yaml tag, nested structs
// as dotted keys, lists of objects as key[].field. A field without a
// comment takes the comment of the field before it when that names it
// ("Min and Max bound …"), else none.
func specFields(root string) ([]specField, error) {
	dir := filepath.Join(root, "batch")
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	type decl struct {
		st *ast.StructType
	}
	types := map[string]decl{}
	for _, f := range files {
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.TYPE {
				continue
			}
			for _, s := range gd.Specs {
				ts := s.(*ast.TypeSpec)
				if st, ok := ts.Type.(*ast.StructType); ok {
					types[ts.Name.Name] = decl{st: st}
				}
			}
		}
	}
	if _, ok := types["Spec"]; !ok {
		return nil, fmt.Errorf("%s: no type Spec", dir)
	}
	var out []specField
	var walk func(typ, prefix string, seen map[string]string) error
	walk = func(typ, prefix string, seen map[string]string) error {
		d := types[typ]
		prev := ""
		for _, f := range d.st.Fields.List {
			doc := f.Doc.Text()
			if doc == "" && len(f.Names) > 0 && strings.Contains(prev, f.Names[0].Name) {
				doc = prev // "Min and Max bound the size."
			}
			prev = doc
			if f.Tag == nil || len(f.Names) == 0 {
				continue
			}
			key, _, _ := strings.Cut(reflect.StructTag(strings.Trim(f.Tag.Value, "`")).Get("yaml"), ",")
			if key == "" || key == "-" {
				continue
			}
			// A key without a comment of its own has no description
			// ("—" on the page): its struct's comment is about the
			// struct, not the key.
			key = prefix + key
			kind, elem, list := typeOf(f.Type)
			_, isStruct := types[elem]
			switch {
			case isStruct && list:
				kind = "list of objects"
			case isStruct:
				kind = "object"
			}
			out = append(out, specField{Key: key, Type: kind, Doc: oneLine(doc)})
			if !isStruct || elem == "Duration" {
				continue
			}
			sub := key + "."
			if list {
				sub = key + "[]."
			}
			if at, ok := seen[elem]; ok {
				out[len(out)-1].Doc += fmt.Sprintf(" Each has the keys of `%s`.", strings.TrimSuffix(at, "."))
				continue
			}
			next := map[string]string{elem: sub}
			for k, v := range seen {
				next[k] = v
			}
			if err := walk(elem, sub, next); err != nil {
				return err
			}
		}
		return nil
	}
	return out, walk("Spec", "", map[string]string{"Spec": ""})
}

// typeOf names a field's type for the page and returns the element type's
// name and whether it is a list.
func typeOf(e ast.Expr) (kind, elem string, list bool) {
	switch t := e.(type) {
	case *ast.StarExpr:
		return typeOf(t.X)
	case *ast.ArrayType:
		k, el, _ := typeOf(t.Elt)
		return "list of " + plural(k), el, true
	case *ast.Ident:
		switch t.Name {
		case "string":
			return "string", t.Name, false
		case "bool":
			return "boolean", t.Name, false
		case "int", "int32", "int64":
			return "integer", t.Name, false
		case "float64":
			return "number", t.Name, false
		case "Duration":
			return "duration", t.Name, false
		}
		return t.Name, t.Name, false
	}
	return fmt.Sprintf("%T", e), "", false
}

func plural(k string) string {
	if k == "" || strings.HasSuffix(k, "s") {
		return k
	}
	return k + "s"
}

// docLinkRE is a Go doc link ([Name], [pkg.Name]); [id] in "Default:
// [id]" is a YAML list, not a link.
var docLinkRE = regexp.MustCompile(`\[((?:[a-z][a-z0-9]*\.)?[A-Z][A-Za-z0-9_]*)\]`)

// oneLine is a doc comment on one line, Go doc links as plain names.
func oneLine(doc string) string {
	return docLinkRE.ReplaceAllString(strings.Join(strings.Fields(doc), " "), "$1")
}

// summary is what the page shows of a field's comment: its first sentence
// and every sentence that states a default, a requirement or a special
// value.
func summary(doc string) string {
	sentences := splitSentences(doc)
	if len(sentences) == 0 {
		return ""
	}
	keep := []string{sentences[0]}
	for _, s := range sentences[1:] {
		if specialRE.MatchString(s) {
			keep = append(keep, s)
		}
	}
	return strings.Join(keep, " ")
}

var specialRE = regexp.MustCompile(`\b([Dd]efaults?|Required|means|turns)\b|^-?[0-9]+:`)

// splitSentences splits at ". " before an upper-case letter, a digit or a
// quote ("e.g." and "i.e." do not end a sentence).
func splitSentences(s string) []string {
	var out []string
	start := 0
	for i := 0; i+2 < len(s); i++ {
		if s[i] != '.' || s[i+1] != ' ' {
			continue
		}
		next := s[i+2]
		if !(next >= 'A' && next <= 'Z' || next >= '0' && next <= '9' || next == '"' || next == '-') {
			continue
		}
		if w := s[start : i+1]; strings.HasSuffix(w, "e.g.") || strings.HasSuffix(w, "i.e.") {
			continue
		}
		out = append(out, strings.TrimSpace(s[start:i+1]))
		start = i + 2
	}
	if rest := strings.TrimSpace(s[start:]); rest != "" {
		out = append(out, rest)
	}
	return out
}

// renderSpec is the page's section on job spec keys.
func renderSpec(w *strings.Builder, fields []specField) {
	fmt.Fprintf(w, "## Job spec keys\n\n")
	fmt.Fprintf(w, "The keys of a job spec file (`batcher run --spec FILE`, YAML or JSON), read from the Go\n")
	fmt.Fprintf(w, "declaration of `batch.Spec` and its doc comments (the first sentence, and those naming a default\n")
	fmt.Fprintf(w, "or a special value). An unset key takes its default. `key[].sub` is a key of each item of a list.\n\n")
	fmt.Fprintf(w, "| Key | Type | Description |\n|---|---|---|\n")
	for _, f := range fields {
		desc := cell(summary(f.Doc))
		if desc == "" {
			desc = "—"
		}
		fmt.Fprintf(w, "| `%s` | %s | %s |\n", f.Key, f.Type, desc)
	}
	fmt.Fprintf(w, "\n")
}
