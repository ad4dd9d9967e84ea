//! Tables: the cells of one, rendered as text (comfy-table) and as HTML from the same strings.

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};

/// The cells of a table, rendered to text and to HTML from the same strings so that both
/// always show the same figures.
pub struct Grid {
    pub title: String,
    pub lines: Vec<String>,
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Lines under the table, shown as they are ("note: …", "hint: …").
    pub notes: Vec<String>,
    /// Without borders: the per-cell log sits under every cell and must stay small.
    pub compact: bool,
}

/// `text` with its control characters written as escapes (`\x1b`): a name from a file or
/// from the user (a snapshot's filename, an experiment's) can't move the terminal's cursor or
/// change its colours. Newlines and tabs are kept; HTML and JSON escape on their own.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    let control = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !text.chars().any(control) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if control(c) && (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if control(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out.into()
}

impl Grid {
    /// The table as text, every string through `printable`.
    pub fn to_text(&self) -> String {
        let mut table = Table::new();
        let shown = |cells: &[String]| cells.iter().map(|cell| printable(cell).into_owned()).collect::<Vec<_>>();
        table
            .load_style(if self.compact { presets::NOTHING } else { presets::UTF8_FULL_CONDENSED })
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header(shown(&self.header));
        for row in &self.rows {
            table.add_row(shown(row));
        }
        for (column, align) in table.column_iter_mut().zip(self.alignments()) {
            column.set_cell_alignment(match align {
                Align::Left => CellAlignment::Left,
                Align::Right => CellAlignment::Right,
            });
        }
        let mut out = String::new();
        out.push_str(&printable(&self.title));
        out.push('\n');
        for line in &self.lines {
            out.push_str(&printable(line));
            out.push('\n');
        }
        out.push_str(&table.to_string());
        for note in &self.notes {
            out.push('\n');
            out.push_str(&printable(note));
        }
        out
    }

    /// How each column lines up, by what it holds: the first column names its rows and every
    /// column of text reads from the left; a column of figures lines up on the right, so that
    /// their digits and units align. A column is text when any of its cells is.
    fn alignments(&self) -> Vec<Align> {
        (0..self.header.len())
            .map(|column| {
                let figures = self.rows.iter().filter_map(|row| row.get(column)).all(|cell| is_figure(cell));
                if column > 0 && figures {
                    Align::Right
                } else {
                    Align::Left
                }
            })
            .collect()
    }

    pub fn to_html(&self) -> String {
        let alignments = self.alignments();
        let align = |column: usize| alignments.get(column).copied().unwrap_or(Align::Left).css();
        let mut out = String::from(if self.compact {
            "<div class=\"gpuexp\" style=\"font-size:smaller\">"
        } else {
            "<div class=\"gpuexp\">"
        });
        out.push_str(&format!("<b>{}</b><br>", escape(&self.title)));
        for line in &self.lines {
            out.push_str(&format!("<span>{}</span><br>", escape(line)));
        }
        out.push_str("<table><thead><tr>");
        for (i, head) in self.header.iter().enumerate() {
            out.push_str(&format!("<th style=\"text-align:{}\">{}</th>", align(i), escape(head)));
        }
        out.push_str("</tr></thead><tbody>");
        for row in &self.rows {
            out.push_str("<tr>");
            for (i, cell) in row.iter().enumerate() {
                out.push_str(&format!("<td style=\"text-align:{}\">{}</td>", align(i), escape(cell)));
            }
            out.push_str("</tr>");
        }
        out.push_str("</tbody></table>");
        for note in &self.notes {
            out.push_str(&format!("<small>{}</small><br>", escape(note)));
        }
        out.push_str("</div>");
        out
    }
}

/// Lines under a table, each under its label ("note: …", "hint: …").
pub fn prefixed(label: &str, lines: &[String]) -> Vec<String> {
    lines.iter().map(|line| format!("{label}: {line}")).collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Align {
    Left,
    Right,
}

impl Align {
    fn css(self) -> &'static str {
        match self {
            Align::Left => "left",
            Align::Right => "right",
        }
    }
}

/// A figure: a number, maybe signed, with what follows it (`1.00 GiB`, `+3 MiB`, `85.5%`,
/// `2.0×`, `80.00 GiB total`), or a cell that stands for none (empty, `—`). A comma makes it
/// prose (`2.0×, linear in bs`), as does anything that starts with a letter or a symbol.
fn is_figure(cell: &str) -> bool {
    let cell = cell.trim();
    let unsigned = cell.trim_start_matches(['+', '-', '−', '±', '~']);
    matches!(cell, "" | "—" | "-") || (unsigned.starts_with(|c: char| c.is_ascii_digit()) && !cell.contains(','))
}

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Reading the cells back out of both renderings, for tests of every table.
#[cfg(test)]
pub(crate) mod testing {
    use super::Grid;

    /// The cells of the comfy-table box in `text`, header first.
    pub(crate) fn text_cells(text: &str) -> Vec<Vec<String>> {
        text.lines()
            .filter(|line| line.starts_with('│'))
            .map(|line| line.trim_matches('│').split(['│', '┆']).map(|cell| cell.trim().to_string()).collect())
            .collect()
    }

    fn unescape(html: &str) -> String {
        html.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&amp;", "&")
    }

    /// The cells of every `<tr>` in `html`, header first, unescaped.
    pub(crate) fn html_cells(html: &str) -> Vec<Vec<String>> {
        html.split("<tr>")
            .skip(1)
            .map(|row| {
                let row = &row[..row.find("</tr>").expect("every row is closed")];
                // Each piece after "<td" or "<th" is ` style="...">CELL</td>`.
                row.split('<')
                    .filter(|piece| ["td ", "th ", "td>", "th>"].iter().any(|tag| piece.starts_with(tag)))
                    .map(|piece| unescape(&piece[piece.find('>').expect("a tag ends") + 1..]))
                    .collect()
            })
            .collect()
    }

    pub(crate) fn expected_cells(grid: &Grid) -> Vec<Vec<String>> {
        std::iter::once(grid.header.clone()).chain(grid.rows.iter().cloned()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{expected_cells, html_cells, text_cells};
    use super::*;

    fn grid(compact: bool) -> Grid {
        Grid {
            title: "t <1> & \"2\"".into(),
            lines: vec!["line <a>".into()],
            header: ["memory", "size"].map(String::from).to_vec(),
            rows: vec![vec!["x<y".into(), "1.00 GiB".into()], vec!["a & b".into(), "\"q\"".into()]],
            notes: prefixed("note", &["n > m".to_string()]),
            compact,
        }
    }

    #[test]
    fn text_and_html_show_the_same_cells_and_html_escapes_every_string() {
        let g = grid(false);
        assert_eq!(text_cells(&g.to_text()), expected_cells(&g));
        assert_eq!(html_cells(&g.to_html()), expected_cells(&g));
        let html = g.to_html();
        for raw in ["<1>", "<a>", "x<y", "n > m", "\"q\""] {
            assert!(!html.contains(raw), "{raw} unescaped in {html}");
        }
        assert!(html.contains("<b>t &lt;1&gt; &amp; &quot;2&quot;</b>"), "{html}");
        assert!(
            html.contains("<span>line &lt;a&gt;</span>") && html.contains("<small>note: n &gt; m</small>"),
            "{html}"
        );
    }

    fn table(rows: &[[&str; 4]]) -> Grid {
        Grid {
            title: "t".into(),
            lines: Vec::new(),
            header: ["site", "line", "bytes", "growth"].map(String::from).to_vec(),
            rows: rows.iter().map(|row| row.map(String::from).to_vec()).collect(),
            notes: Vec::new(),
            compact: false,
        }
    }

    #[test]
    fn control_characters_from_names_are_escaped_in_text_and_left_to_html() {
        let mut grid = table(&[["\x1b[31mIn [1], line 2", "x\u{9b}y", "1 B", "2 B"]]);
        grid.title = "gpuexp · \x1b[31mx".into();
        grid.notes = vec!["note: \x07".into()];
        let text = grid.to_text();
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        for shown in ["gpuexp · \\x1b[31mx", "\\x1b[31mIn [1], line 2", "x\\x9by", "note: \\x07"] {
            assert!(text.contains(shown), "{shown} in {text}");
        }
        assert_eq!(printable("plain\ttext"), "plain\ttext");
    }

    #[test]
    fn labels_and_text_are_left_aligned_and_figures_right() {
        let g = table(&[
            ["In [2], line 16", "w = s.softmax(-1)", "512.00 MiB", "2.0×, linear in bs"],
            ["(before)", "", "—", "new"],
        ]);
        let text = g.to_text();
        assert!(text.contains("│ site            ┆ line              ┆      bytes ┆ growth             │"), "{text}");
        assert!(text.contains("│ In [2], line 16 ┆ w = s.softmax(-1) ┆ 512.00 MiB ┆ 2.0×, linear in bs │"), "{text}");
        assert!(text.contains("│ (before)        ┆                   ┆          — ┆ new                │"), "{text}");
        let html = g.to_html();
        let head = "<th style=\"text-align:left\">line</th><th style=\"text-align:right\">bytes</th>";
        assert!(html.contains(head), "{html}");
        let row = "<td style=\"text-align:left\">w = s.softmax(-1)</td><td style=\"text-align:right\">512.00 MiB</td>";
        assert!(html.contains(row), "{html}");
    }

    #[test]
    fn a_column_is_figures_only_when_every_cell_is_one() {
        for figure in ["1.00 GiB", "+3 MiB", "-65.00 MiB", "−2 B", "85.5%", "2.0×", "80.00 GiB total", "12", "—", ""]
        {
            assert!(is_figure(figure), "{figure}");
        }
        for text in ["tensor [16, 256]", "2.0×, linear in bs", "new", "x = 1", "cuda:0", "(no Python tensor)"] {
            assert!(!is_figure(text), "{text}");
        }
        // The first column names the rows, even when they are numbers (ranks).
        let g = table(&[["0", "a", "1 B", "2"], ["1", "3", "2 B", "4"]]);
        assert_eq!(g.alignments(), [Align::Left, Align::Left, Align::Right, Align::Right]);
    }

    #[test]
    fn a_compact_grid_has_no_borders_and_smaller_html() {
        let text = grid(true).to_text();
        assert!(!text.contains('│') && !text.contains('─'), "{text}");
        assert!(text.starts_with("t <1> & \"2\"\nline <a>\n") && text.ends_with("\nnote: n > m"), "{text}");
        assert!(grid(true).to_html().starts_with("<div class=\"gpuexp\" style=\"font-size:smaller\"><b>"));
        assert!(grid(false).to_html().starts_with("<div class=\"gpuexp\"><b>"));
    }
}
