//! One string column of an Arrow IPC file, streamed: Hugging Face's cache files (`.arrow`, the
//! IPC *stream* format) and IPC *files* (`ARROW1` magic, the same messages framed by a footer).
//!
//! The arrow crates would cost CI minutes of build (arrow-ipc pulls arrow-select and arrow-cmp)
//! for what is a short walk: each message is a FlatBuffer (its schema in the Arrow repository's
//! `format/Message.fbs` and `Schema.fbs`) followed by a body. The schema message gives the
//! columns; every record batch gives, in the schema's depth-first order, one node per field
//! and its buffers, so the column's validity, offsets and data buffers are found by counting the
//! buffers of the fields before it. Only what a text column needs is read: `Utf8` and
//! `LargeUtf8` columns, uncompressed bodies, little-endian. Anything else is refused with a line
//! that says what it found. Batches are read one at a time, so memory holds one batch.

use std::io::Read;

use anyhow::{Result, anyhow, bail};

/// A read-only view of a FlatBuffer table: just the accessors the Arrow messages need. Every
/// position is computed with checked arithmetic and every read is bounds-checked, so a crafted
/// message is refused (`a message points past its end`), never read out of range.
#[derive(Clone, Copy)]
struct Table<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// `n` bytes of `buf` at `pos`, or the error every out-of-range read of a message gives.
fn bytes_at(buf: &[u8], pos: usize, n: usize) -> Result<&[u8]> {
    pos.checked_add(n).and_then(|end| buf.get(pos..end)).ok_or_else(|| anyhow!("a message points past its end"))
}

fn u32_at(buf: &[u8], pos: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(bytes_at(buf, pos, 4)?.try_into().expect("4 bytes")))
}

/// `pos` moved forward by `by` (a FlatBuffer offset), refused where it would overflow.
fn forward(pos: usize, by: usize) -> Result<usize> {
    pos.checked_add(by).ok_or_else(|| anyhow!("a message points past its end"))
}

impl<'a> Table<'a> {
    fn root(buf: &'a [u8]) -> Result<Table<'a>> {
        let pos = u32_at(buf, 0)? as usize;
        Table::at(buf, pos)
    }

    fn at(buf: &'a [u8], pos: usize) -> Result<Table<'a>> {
        bytes_at(buf, pos, 4)?;
        Ok(Table { buf, pos })
    }

    /// Where field `slot` (0, 1, ...) is stored, if present.
    fn field(&self, slot: usize) -> Result<Option<usize>> {
        let soffset = i32::from_le_bytes(bytes_at(self.buf, self.pos, 4)?.try_into().expect("4 bytes"));
        let vtable =
            usize::try_from(self.pos as i64 - soffset as i64).map_err(|_| anyhow!("a message points past its end"))?;
        let u16_at = |at: usize| -> Result<usize> {
            Ok(u16::from_le_bytes(bytes_at(self.buf, at, 2)?.try_into().expect("2 bytes")) as usize)
        };
        let vtable_len = u16_at(vtable)?;
        let entry = 4 + 2 * slot;
        if entry + 2 > vtable_len {
            return Ok(None);
        }
        let offset = u16_at(forward(vtable, entry)?)?;
        Ok((offset != 0).then_some(self.pos + offset))
    }

    fn scalar<const N: usize>(&self, slot: usize) -> Result<Option<[u8; N]>> {
        match self.field(slot)? {
            None => Ok(None),
            Some(at) => Ok(Some(bytes_at(self.buf, at, N)?.try_into().expect("N bytes"))),
        }
    }

    fn u8(&self, slot: usize) -> Result<u8> {
        Ok(self.scalar::<1>(slot)?.map_or(0, |b| b[0]))
    }

    fn i16(&self, slot: usize) -> Result<i16> {
        Ok(self.scalar::<2>(slot)?.map_or(0, i16::from_le_bytes))
    }

    fn i64(&self, slot: usize) -> Result<i64> {
        Ok(self.scalar::<8>(slot)?.map_or(0, i64::from_le_bytes))
    }

    /// The position after following the offset stored in field `slot`.
    fn indirect(&self, slot: usize) -> Result<Option<usize>> {
        match self.field(slot)? {
            None => Ok(None),
            Some(at) => Ok(Some(forward(at, u32_at(self.buf, at)? as usize)?)),
        }
    }

    fn table(&self, slot: usize) -> Result<Option<Table<'a>>> {
        self.indirect(slot)?.map(|at| Table::at(self.buf, at)).transpose()
    }

    /// A vector's length and where its elements start.
    fn vector(&self, slot: usize) -> Result<Option<(usize, usize)>> {
        let Some(at) = self.indirect(slot)? else { return Ok(None) };
        Ok(Some((u32_at(self.buf, at)? as usize, forward(at, 4)?)))
    }

    fn string(&self, slot: usize) -> Result<Option<&'a str>> {
        let Some((len, at)) = self.vector(slot)? else { return Ok(None) };
        let b = bytes_at(self.buf, at, len)?;
        Ok(Some(std::str::from_utf8(b).map_err(|_| anyhow!("a field name is not UTF-8"))?))
    }

    /// A vector of tables.
    fn tables(&self, slot: usize) -> Result<Vec<Table<'a>>> {
        let Some((len, at)) = self.vector(slot)? else { return Ok(Vec::new()) };
        // Each element is a 4-byte offset: a length the message cannot hold is refused before
        // anything is allocated for it.
        bytes_at(self.buf, at, len.checked_mul(4).ok_or_else(|| anyhow!("a message points past its end"))?)?;
        (0..len)
            .map(|i| {
                let e = at + 4 * i;
                Table::at(self.buf, forward(e, u32_at(self.buf, e)? as usize)?)
            })
            .collect()
    }

    /// A vector of structs of two i64 (FieldNode, Buffer).
    fn pairs(&self, slot: usize) -> Result<Vec<(i64, i64)>> {
        let Some((len, at)) = self.vector(slot)? else { return Ok(Vec::new()) };
        let n = len.checked_mul(16).ok_or_else(|| anyhow!("a message points past its end"))?;
        Ok(bytes_at(self.buf, at, n)?
            .chunks_exact(16)
            .map(|c| {
                (i64::from_le_bytes(c[..8].try_into().expect("8")), i64::from_le_bytes(c[8..].try_into().expect("8")))
            })
            .collect())
    }
}

// Message.fbs: Message { version, header_type, header, bodyLength, custom_metadata }.
const HEADER_SCHEMA: u8 = 1;
const HEADER_DICTIONARY: u8 = 2;
const HEADER_RECORD_BATCH: u8 = 3;
// Schema.fbs: the `Type` union's members that matter.
const TYPE_UTF8: u8 = 5;
const TYPE_LARGE_UTF8: u8 = 20;

/// The `Type` union's names, for messages.
fn type_name(t: u8) -> &'static str {
    const NAMES: [&str; 27] = [
        "none",
        "null",
        "int",
        "floating point",
        "binary",
        "utf8",
        "bool",
        "decimal",
        "date",
        "time",
        "timestamp",
        "interval",
        "list",
        "struct",
        "union",
        "fixed-size binary",
        "fixed-size list",
        "map",
        "duration",
        "large binary",
        "large utf8",
        "large list",
        "run-end encoded",
        "binary view",
        "utf8 view",
        "list view",
        "large list view",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown")
}

/// How many buffers a field of this type has in a record batch (its children's not counted),
/// from the columnar format's buffer layouts; `None` for layouts whose count varies per batch.
fn own_buffers(field: &Table) -> Result<Option<usize>> {
    if field.table(4)?.is_some() {
        return Ok(Some(2)); // dictionary-encoded: validity and indices
    }
    let t = field.u8(2)?;
    Ok(match t {
        1 => Some(0),                                                                              // null
        2 | 3 | 6..=11 | 15 | 18 => Some(2), // fixed width: validity, values
        4 | 5 | 19 | 20 => Some(3),          // validity, offsets, data
        12 | 17 | 21 => Some(2),             // lists, maps: validity, offsets
        13 | 16 => Some(1),                  // struct, fixed-size list: validity
        14 => Some(if field.table(3)?.map(|u| u.i16(0)).transpose()? == Some(1) { 2 } else { 1 }), // union: dense has offsets
        22 => Some(0),      // run-end encoded: its children hold the data
        25 | 26 => Some(3), // list views: validity, offsets, sizes
        _ => None,          // views (variadic buffers) and the unknown
    })
}

/// How deeply a schema's fields may nest: Arrow's own IPC readers stop at 64 levels
/// (`IpcReadOptions::max_recursion_depth` in Arrow C++). The walk below is recursive, and a
/// crafted schema nested 300,000 levels deep overflowed the reader thread's stack.
pub const MAX_DEPTH: usize = 64;

/// How many fields (nested ones included) a schema may have before the column: a bound on the
/// walk, since a FlatBuffer may list one child table many times over (64 levels of two
/// references to the same child would be 2^64 visits).
pub const MAX_FIELDS: usize = 1 << 20;

/// Nodes and buffers a field and its descendants take, depth first; `depth` is the field's own
/// (1 for a column) and `fields` counts the fields walked so far, against [`MAX_FIELDS`].
fn span(field: &Table, depth: usize, fields: &mut usize) -> Result<Option<(usize, usize)>> {
    if depth > MAX_DEPTH {
        bail!("the schema nests fields more than {MAX_DEPTH} levels deep, which Arrow's own readers refuse too");
    }
    *fields += 1;
    if *fields > MAX_FIELDS {
        bail!("the schema has more than {MAX_FIELDS} fields before the column, more than this reader walks");
    }
    let Some(mut buffers) = own_buffers(field)? else { return Ok(None) };
    let mut nodes = 1;
    for child in field.tables(5)? {
        let Some((n, b)) = span(&child, depth + 1, fields)? else { return Ok(None) };
        nodes += n;
        buffers += b;
    }
    Ok(Some((nodes, buffers)))
}

/// Where the column is in every record batch.
struct Column {
    node: usize,
    buffer: usize,
    large: bool,
}

/// Reads one message: its FlatBuffer metadata and its body. `None` at the end of the stream.
fn next_message(r: &mut dyn Read, first: &mut bool) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut word = [0u8; 4];
    if !read_full(r, &mut word)? {
        return Ok(None); // a stream without its end marker, as some writers leave it
    }
    if *first && &word == b"ARRO" {
        // The file format: `ARROW1`, two bytes of padding, then the stream.
        let mut rest = [0u8; 4];
        if !read_full(r, &mut rest)? || &rest != b"W1\0\0" {
            bail!("not an Arrow IPC file (no stream or file header)");
        }
        if !read_full(r, &mut word)? {
            return Ok(None);
        }
    }
    *first = false;
    if word == [0xff; 4] && !read_full(r, &mut word)? {
        bail!("the stream ends inside a message header");
    }
    let len = i32::from_le_bytes(word);
    if len == 0 {
        return Ok(None); // the end-of-stream marker
    }
    if !(8..=1 << 28).contains(&len) {
        bail!("not an Arrow IPC stream (a message of {len} bytes)");
    }
    let mut meta = vec![0u8; len as usize];
    if !read_full(r, &mut meta)? {
        bail!("the stream ends inside a message (truncated?)");
    }
    let message = Table::root(&meta)?;
    let body_len = message.i64(3)?;
    if !(0..=1 << 40).contains(&body_len) {
        bail!("a message declares a body of {body_len} bytes");
    }
    let mut body = Vec::new();
    r.take(body_len as u64).read_to_end(&mut body)?;
    if body.len() as i64 != body_len {
        bail!("the stream ends inside a record batch (truncated?)");
    }
    Ok(Some((meta, body)))
}

/// Fills `buf`; false when the reader is at its end before the first byte.
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> Result<bool> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) if n == 0 => return Ok(false),
            Ok(0) => bail!("the stream ends inside a message (truncated?)"),
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Streams the strings of column `name`, calling `emit` with each row's 1-based number and text.
/// Errors say what is wrong; the caller names the file.
pub fn read_column(r: &mut dyn Read, name: &str, emit: &mut dyn FnMut(u64, &str) -> Result<()>) -> Result<()> {
    let mut first = true;
    let mut column: Option<Column> = None;
    let mut row = 0u64;
    while let Some((meta, body)) = next_message(r, &mut first)? {
        let message = Table::root(&meta)?;
        let header = message.table(2)?.ok_or_else(|| anyhow!("a message without a header"))?;
        match message.u8(1)? {
            HEADER_SCHEMA => {
                if header.i16(0)? != 0 {
                    bail!("the file is big-endian, which is not supported");
                }
                let fields = header.tables(1)?;
                let (mut node, mut buffer, mut walked) = (0, 0, 0);
                let mut found = None;
                for f in &fields {
                    if f.string(0)? == Some(name) {
                        let t = f.u8(2)?;
                        if f.table(4)?.is_some() {
                            bail!("column `{name}` is dictionary-encoded, which is not supported");
                        }
                        if t != TYPE_UTF8 && t != TYPE_LARGE_UTF8 {
                            bail!("column `{name}` holds {}, not strings", type_name(t));
                        }
                        found = Some(Column { node, buffer, large: t == TYPE_LARGE_UTF8 });
                        break;
                    }
                    let (n, b) = span(f, 1, &mut walked)?.ok_or_else(|| {
                        anyhow!(
                            "column `{}` before `{name}` has a layout this reader does not support",
                            f.string(0).ok().flatten().unwrap_or("?")
                        )
                    })?;
                    node += n;
                    buffer += b;
                }
                let Some(c) = found else {
                    let names: Vec<&str> = fields.iter().filter_map(|f| f.string(0).ok().flatten()).collect();
                    bail!("no column `{name}` (the columns: {})", names.join(", "));
                };
                column = Some(c);
            }
            HEADER_RECORD_BATCH => {
                let c = column.as_ref().ok_or_else(|| anyhow!("a record batch before the schema"))?;
                if header.table(3)?.is_some() {
                    bail!("the record batches are compressed, which is not supported");
                }
                let nodes = header.pairs(1)?;
                let buffers = header.pairs(2)?;
                let &(length, nulls) = nodes.get(c.node).ok_or_else(|| anyhow!("a record batch lacks the column"))?;
                let bufs =
                    buffers.get(c.buffer..c.buffer + 3).ok_or_else(|| anyhow!("a record batch lacks the column"))?;
                let slice = |(offset, len): (i64, i64)| -> Result<&[u8]> {
                    usize::try_from(offset)
                        .ok()
                        .zip(usize::try_from(len).ok())
                        .and_then(|(o, l)| body.get(o..o.checked_add(l)?))
                        .ok_or_else(|| anyhow!("a buffer lies outside its record batch"))
                };
                let (validity, offsets, data) = (slice(bufs[0])?, slice(bufs[1])?, slice(bufs[2])?);
                let width = if c.large { 8 } else { 4 };
                // Rows need `width` bytes of offsets each (and one more offset): a row count
                // the body cannot hold is refused before any arithmetic on it can wrap.
                let length = usize::try_from(length)
                    .ok()
                    .filter(|&n| n.checked_add(1).and_then(|n| n.checked_mul(width)).is_some_and(|b| b <= offsets.len()))
                    .ok_or_else(|| {
                        anyhow!(
                            "a record batch declares {length} rows, but its offsets buffer of {} bytes holds at most {}",
                            offsets.len(),
                            (offsets.len() / width).saturating_sub(1)
                        )
                    })?;
                if nulls > 0 && validity.len() < length.div_ceil(8) {
                    bail!(
                        "a record batch's validity buffer of {} bytes is shorter than its {length} rows",
                        validity.len()
                    );
                }
                let offset = |i: usize| -> usize {
                    let b = &offsets[i * width..(i + 1) * width];
                    if c.large {
                        i64::from_le_bytes(b.try_into().expect("8")) as usize
                    } else {
                        i32::from_le_bytes(b.try_into().expect("4")) as u32 as usize
                    }
                };
                for i in 0..length {
                    row += 1;
                    if nulls > 0 && validity[i / 8] & (1 << (i % 8)) == 0 {
                        bail!("row {row}: the `{name}` cell is null");
                    }
                    let bytes = data
                        .get(offset(i)..offset(i + 1))
                        .ok_or_else(|| anyhow!("row {row}: offsets outside the data"))?;
                    let text = std::str::from_utf8(bytes).map_err(|_| anyhow!("row {row}: not valid UTF-8"))?;
                    emit(row, text)?;
                }
            }
            HEADER_DICTIONARY => {}
            other => bail!("not an Arrow IPC stream (a message of type {other})"),
        }
    }
    if column.is_none() {
        bail!("not an Arrow IPC stream (no schema)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A field of a FlatBuffer table, for writing test messages: scalars inline, the rest behind
    /// an offset.
    enum F {
        No,
        U8(u8),
        I16(i16),
        I64(i64),
        Str(&'static str),
        Table(Vec<F>),
        /// A vector of tables (each a `Table` or a `Nested`).
        Tables(Vec<F>),
        /// A vector of (i64, i64) structs.
        Pairs(Vec<(i64, i64)>),
        /// A struct field `depth` levels deep, each level listing the next `fanout` times: written
        /// in a loop, since a crafted schema is deeper than a recursive writer's stack.
        Nested {
            depth: usize,
            fanout: usize,
        },
    }

    fn patch(out: &mut [u8], at: usize, target: usize) {
        out[at..at + 4].copy_from_slice(&((target - at) as u32).to_le_bytes());
    }

    /// Writes a table (its vtable first, then the table, then what its offsets point to, so every
    /// offset points forward as FlatBuffers' do); returns the table's position.
    fn table(out: &mut Vec<u8>, fields: &[F]) -> usize {
        let size = |f: &F| match f {
            F::No => 0,
            F::U8(_) => 1,
            F::I16(_) => 2,
            F::I64(_) => 8,
            _ => 4,
        };
        let vtable = out.len();
        out.extend((4 + 2 * fields.len() as u16).to_le_bytes());
        out.extend((4 + fields.iter().map(size).sum::<usize>() as u16).to_le_bytes());
        let mut at = 4;
        for f in fields {
            out.extend((if size(f) == 0 { 0 } else { at as u16 }).to_le_bytes());
            at += size(f);
        }
        let pos = out.len();
        out.extend(((pos - vtable) as i32).to_le_bytes());
        let mut refs = Vec::new();
        for f in fields {
            match f {
                F::No => {}
                F::U8(v) => out.push(*v),
                F::I16(v) => out.extend(v.to_le_bytes()),
                F::I64(v) => out.extend(v.to_le_bytes()),
                _ => {
                    refs.push((out.len(), f));
                    out.extend([0; 4]);
                }
            }
        }
        for (at, f) in refs {
            let target = child(out, f);
            patch(out, at, target);
        }
        pos
    }

    fn child(out: &mut Vec<u8>, f: &F) -> usize {
        let pos = out.len();
        match f {
            F::Str(s) => {
                out.extend((s.len() as u32).to_le_bytes());
                out.extend(s.as_bytes());
            }
            F::Table(fields) => return table(out, fields),
            F::Tables(tables) => {
                out.extend((tables.len() as u32).to_le_bytes());
                out.resize(out.len() + 4 * tables.len(), 0);
                for (i, t) in tables.iter().enumerate() {
                    let target = child(out, t);
                    patch(out, pos + 4 + 4 * i, target);
                }
            }
            F::Pairs(pairs) => {
                out.extend((pairs.len() as u32).to_le_bytes());
                pairs.iter().for_each(|(a, b)| out.extend(a.to_le_bytes().into_iter().chain(b.to_le_bytes())));
            }
            &F::Nested { depth, fanout } => {
                // One vtable for every level: type_type (slot 2) at 4, children (slot 5) at 5.
                out.extend([16, 0, 9, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 5, 0]);
                let first = out.len();
                for level in 0..depth {
                    let at = out.len();
                    out.extend(((at - pos) as i32).to_le_bytes());
                    out.push(13); // struct
                    out.extend(4u32.to_le_bytes()); // the children vector follows
                    let children = if level + 1 == depth { 0 } else { fanout };
                    out.extend((children as u32).to_le_bytes());
                    // Every child is the next level's table, right after this vector.
                    let next = out.len() + 4 * children;
                    for _ in 0..children {
                        out.extend(((next - out.len()) as u32).to_le_bytes());
                    }
                }
                return first;
            }
            _ => unreachable!("a scalar is written inline"),
        }
        pos
    }

    /// An encapsulated IPC message: continuation marker, metadata length, metadata, body.
    fn message(header_type: u8, header: Vec<F>, body: &[u8]) -> Vec<u8> {
        let mut meta = vec![0; 4];
        let root = table(&mut meta, &[F::I16(4), F::U8(header_type), F::Table(header), F::I64(body.len() as i64)]);
        patch(&mut meta, 0, root);
        let mut out = vec![0xff; 4];
        out.extend((meta.len() as i32).to_le_bytes());
        out.extend(meta);
        out.extend(body);
        out
    }

    /// A `utf8` field named `name`.
    fn utf8(name: &'static str) -> F {
        F::Table(vec![F::Str(name), F::U8(1), F::U8(TYPE_UTF8), F::Table(vec![]), F::No, F::Tables(vec![])])
    }

    /// A stream of a schema with `fields`, then one record batch of `rows` rows over the column
    /// found after them (`structs` struct fields before it, empty): the strings "ab" and "c".
    fn stream(fields: Vec<F>, structs: usize, rows: i64) -> Vec<u8> {
        let mut out = message(HEADER_SCHEMA, vec![F::I16(0), F::Tables(fields)], &[]);
        let mut body = Vec::new();
        [0i32, 2, 3].iter().for_each(|o| body.extend(o.to_le_bytes()));
        body.extend(b"abc");
        let nodes = [vec![(0, 0); structs], vec![(rows, 0)]].concat();
        let buffers = [vec![(0, 0); structs], vec![(0, 0), (0, 12), (12, 3)]].concat();
        out.extend(message(HEADER_RECORD_BATCH, vec![F::I64(rows), F::Pairs(nodes), F::Pairs(buffers)], &body));
        out.extend([0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
        out
    }

    fn read(bytes: &[u8]) -> Result<Vec<String>> {
        let mut rows = Vec::new();
        read_column(&mut &bytes[..], "text", &mut |_, text| {
            rows.push(text.to_owned());
            Ok(())
        })?;
        Ok(rows)
    }

    #[test]
    fn a_written_stream_reads_back() {
        assert_eq!(read(&stream(vec![utf8("text")], 0, 2)).unwrap(), ["ab", "c"]);
        let shallow = F::Nested { depth: MAX_DEPTH, fanout: 1 };
        assert_eq!(read(&stream(vec![shallow, utf8("text")], MAX_DEPTH, 2)).unwrap(), ["ab", "c"]);
    }

    /// A row count whose offsets' size, `(rows + 1) × 4`, wraps around to 0 passed the length
    /// check, then indexed the 12-byte offsets buffer past its end (a panic, exit 101).
    #[test]
    fn a_row_count_the_body_cannot_hold_is_refused() {
        let e = read(&stream(vec![utf8("text")], 0, (1 << 62) - 1)).unwrap_err().to_string();
        assert_eq!(
            e,
            "a record batch declares 4611686018427387903 rows, but its offsets buffer of 12 bytes holds at most 2"
        );
        assert!(read(&stream(vec![utf8("text")], 0, 3)).unwrap_err().to_string().contains("declares 3 rows"));
        assert!(read(&stream(vec![utf8("text")], 0, -1)).unwrap_err().to_string().contains("declares -1 rows"));
    }

    /// A schema nested 300,000 levels deep overflowed the stack (an abort, exit 134); a schema
    /// listing one child many times over would be walked for ever. Both are refused.
    #[test]
    fn deep_and_exploding_schemas_are_refused() {
        let deep = stream(vec![F::Nested { depth: 300_000, fanout: 1 }, utf8("text")], 0, 2);
        let e = read(&deep).unwrap_err().to_string();
        assert!(e.contains("nests fields more than 64 levels deep"), "{e}");
        let wide = stream(vec![F::Nested { depth: MAX_DEPTH, fanout: 2 }, utf8("text")], 0, 2);
        let e = read(&wide).unwrap_err().to_string();
        assert!(e.contains("more than 1048576 fields"), "{e}");
    }
}
