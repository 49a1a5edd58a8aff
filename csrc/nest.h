// Nests of arrays: the values that move between Python, the queues and the
// wire.
//
//   numpy nest --nest_from_python (copy, GIL)--> Nest --concat/split--> Nest
//   Nest --nest_to_python (no copy, GIL)--> numpy arrays owning the C++ buffer
//   rpcenv.ArrayNest --nest_from_proto (takes the bytes)--> Nest --nest_to_proto (copy)--> wire
//
// A Nest is an array, a list, a tuple or a dict (str -> Nest). An Array owns
// its bytes through a shared_ptr, so copying a Nest is cheap and never copies
// data. C++ code never writes into a buffer after creating it; concat and
// split always produce new buffers, so a numpy array handed to Python is the
// only writer of its buffer.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "rpcenv.pb.h"

namespace beast {

namespace py = pybind11;

// NumPy type numbers of the arrays that C++ code creates itself.
namespace dtypes {
constexpr int kBool = 0;
constexpr int kInt32 = 5;  // NPY_INT
constexpr int kInt64 = sizeof(long) == 8 ? 7 : 9;  // NPY_LONG on LP64, else NPY_LONGLONG
constexpr int kFloat32 = 11;
}  // namespace dtypes

// Bytes per element of a NumPy type number; 0 for the types we do not carry
// (object, strings, datetimes, long double).
inline int64_t itemsize_of(int dtype) {
  switch (dtype) {
    case 0:
    case 1:
    case 2: return 1;  // bool, int8, uint8
    case 3:
    case 4:
    case 23: return 2;  // int16, uint16, float16
    case 5:
    case 6:
    case 11: return 4;  // int32, uint32, float32
    case 7:
    case 8: return sizeof(long);  // C long, C unsigned long
    case 9:
    case 10:
    case 12:
    case 14: return 8;  // int64, uint64, float64, complex64
    case 15: return 16;  // complex128
    default: return 0;
  }
}

inline std::string dtype_name(int dtype) {
  static const std::map<int, std::string> names = {
      {0, "bool"},     {1, "int8"},       {2, "uint8"},       {3, "int16"},   {4, "uint16"},
      {5, "int32"},    {6, "uint32"},     {9, "int64"},       {10, "uint64"}, {11, "float32"},
      {12, "float64"}, {14, "complex64"}, {15, "complex128"}, {23, "float16"}};
  if (dtype == 7 || dtype == 8) dtype += sizeof(long) == 8 ? 2 : -2;  // C long: int64 or int32
  auto it = names.find(dtype);
  return it == names.end() ? "NumPy type number " + std::to_string(dtype) : it->second;
}

// NumPy has two type numbers for 64-bit integers on LP64 (long and long long)
// and for 32-bit ones elsewhere; map them to one so that equal dtypes compare
// equal when batching.
inline int canonical_dtype(int dtype) {
  if (sizeof(long) == 8) {
    if (dtype == 9) return 7;
    if (dtype == 10) return 8;
  } else {
    if (dtype == 7) return 5;
    if (dtype == 8) return 6;
  }
  return dtype;
}

inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

// `path` is where a value sits in the nest, e.g. "[0]['frame']".
inline std::string where(const std::string& path) {
  return path.empty() ? "at the top of the nest" : "at " + path;
}

struct Array {
  int dtype = dtypes::kFloat32;  // NumPy type number, canonical
  std::vector<int64_t> shape;
  std::shared_ptr<std::string> data;  // C-order bytes, native byte order

  int64_t itemsize() const { return itemsize_of(dtype); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t nbytes() const { return numel() * itemsize(); }
  const char* bytes() const { return data->data(); }
};

struct Nest {
  enum class Kind { kArray, kList, kTuple, kDict };

  Kind kind = Kind::kTuple;
  Array array;  // kArray
  std::vector<Nest> items;  // kList, kTuple
  std::map<std::string, Nest> fields;  // kDict

  static Nest of(Array a) {
    Nest n;
    n.kind = Kind::kArray;
    n.array = std::move(a);
    return n;
  }
  static Nest tuple(std::vector<Nest> items) {
    Nest n;
    n.kind = Kind::kTuple;
    n.items = std::move(items);
    return n;
  }
  static Nest dict(std::map<std::string, Nest> fields) {
    Nest n;
    n.kind = Kind::kDict;
    n.fields = std::move(fields);
    return n;
  }
};

inline const char* kind_name(Nest::Kind kind) {
  switch (kind) {
    case Nest::Kind::kArray: return "an array";
    case Nest::Kind::kList: return "a list";
    case Nest::Kind::kTuple: return "a tuple";
    case Nest::Kind::kDict: return "a dict";
  }
  return "?";
}

// An array of the given shape (usually [1, 1]) filled with `value`.
template <typename T>
Array filled_array(int dtype, T value, std::vector<int64_t> shape) {
  Array a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  if (a.itemsize() != static_cast<int64_t>(sizeof(T))) {
    throw std::logic_error("filled_array: C++ type does not fit the dtype");
  }
  a.data = std::make_shared<std::string>(a.nbytes(), '\0');
  for (int64_t i = 0; i < a.numel(); ++i) {
    std::memcpy(a.data->data() + i * sizeof(T), &value, sizeof(T));
  }
  return a;
}

// Reads a one-element integer array (e.g. an action) as int64.
inline int64_t to_int64(const Array& a, const std::string& what) {
  if (a.numel() != 1) {
    throw std::invalid_argument(what + " must have exactly one element, got shape " +
                                shape_str(a.shape));
  }
  const char* p = a.bytes();
  auto read = [p](auto zero) {
    decltype(zero) v;
    std::memcpy(&v, p, sizeof(v));
    return static_cast<int64_t>(v);
  };
  switch (a.dtype) {
    case 1: return read(int8_t{});
    case 2: return read(uint8_t{});
    case 3: return read(int16_t{});
    case 4: return read(uint16_t{});
    case 5: return read(int32_t{});
    case 6: return read(uint32_t{});
    case 7: return sizeof(long) == 8 ? read(int64_t{}) : read(int32_t{});
    case 8: return sizeof(long) == 8 ? read(uint64_t{}) : read(uint32_t{});
    case 9: return read(int64_t{});
    case 10: return read(uint64_t{});
    default: throw std::invalid_argument(what + " must have an integer dtype");
  }
}

// ---------------------------------------------------------------------------
// Checks and batching along `dim`.

// The batch size (the size of dimension `dim`) shared by every array of the
// nest; -1 for a nest without arrays. Throws std::invalid_argument (Python
// ValueError) naming the path when an array lacks the dimension, it is empty,
// or two arrays disagree.
inline int64_t batch_size(const Nest& nest, int64_t dim, const std::string& path = "") {
  int64_t size = -1;
  std::string size_path;
  auto merge = [&](int64_t s, const std::string& p) {
    if (s < 0) return;
    if (size >= 0 && s != size) {
      throw std::invalid_argument("batch sizes differ along batch_dim=" + std::to_string(dim) +
                                  ": " + std::to_string(size) + " " + where(size_path) + ", " +
                                  std::to_string(s) + " " + where(p));
    }
    size = s;
    size_path = p;
  };
  switch (nest.kind) {
    case Nest::Kind::kArray: {
      const auto& shape = nest.array.shape;
      if (static_cast<int64_t>(shape.size()) <= dim || shape[dim] < 1) {
        throw std::invalid_argument("array " + where(path) + " of shape " + shape_str(shape) +
                                    " has no batch dimension batch_dim=" + std::to_string(dim) +
                                    " of size 1 or more");
      }
      return shape[dim];
    }
    case Nest::Kind::kList:
    case Nest::Kind::kTuple:
      for (size_t i = 0; i < nest.items.size(); ++i) {
        std::string p = path + "[" + std::to_string(i) + "]";
        merge(batch_size(nest.items[i], dim, p), p);
      }
      return size;
    case Nest::Kind::kDict:
      for (const auto& [key, value] : nest.fields) {
        std::string p = path + "['" + key + "']";
        merge(batch_size(value, dim, p), p);
      }
      return size;
  }
  return size;
}

// Throws std::invalid_argument unless `a` and `b` have the same structure,
// dtypes and shapes in every dimension but `dim`.
inline void check_concatenable(const Nest& a, const Nest& b, int64_t dim,
                               const std::string& path = "") {
  if (a.kind != b.kind) {
    throw std::invalid_argument(std::string("nest structures differ ") + where(path) + ": " +
                                kind_name(a.kind) + " vs " + kind_name(b.kind));
  }
  switch (a.kind) {
    case Nest::Kind::kArray: {
      const Array& x = a.array;
      const Array& y = b.array;
      if (x.dtype != y.dtype) {
        throw std::invalid_argument("dtypes differ " + where(path) + ": " + dtype_name(x.dtype) +
                                    " vs " + dtype_name(y.dtype));
      }
      bool fits = x.shape.size() == y.shape.size() && static_cast<int64_t>(x.shape.size()) > dim;
      for (size_t d = 0; fits && d < x.shape.size(); ++d) {
        fits = static_cast<int64_t>(d) == dim || x.shape[d] == y.shape[d];
      }
      if (!fits) {
        throw std::invalid_argument("shapes do not fit " + where(path) + ": " + shape_str(x.shape) +
                                    " vs " + shape_str(y.shape) +
                                    " (every dimension except batch_dim=" + std::to_string(dim) +
                                    " must agree)");
      }
      return;
    }
    case Nest::Kind::kList:
    case Nest::Kind::kTuple:
      if (a.items.size() != b.items.size()) {
        throw std::invalid_argument(std::string("nest structures differ ") + where(path) + ": " +
                                    kind_name(a.kind) + " of length " +
                                    std::to_string(a.items.size()) + " vs " +
                                    std::to_string(b.items.size()));
      }
      for (size_t i = 0; i < a.items.size(); ++i) {
        check_concatenable(a.items[i], b.items[i], dim, path + "[" + std::to_string(i) + "]");
      }
      return;
    case Nest::Kind::kDict: {
      auto it = b.fields.begin();
      for (const auto& [key, value] : a.fields) {
        if (it == b.fields.end() || it->first != key) {
          std::string other = it == b.fields.end() ? "nothing" : "'" + it->first + "'";
          throw std::invalid_argument("dict keys differ " + where(path) + ": '" + key + "' vs " +
                                      other);
        }
        check_concatenable(value, it->second, dim, path + "['" + key + "']");
        ++it;
      }
      if (it != b.fields.end()) {
        throw std::invalid_argument("dict keys differ " + where(path) + ": extra key '" +
                                    it->first + "'");
      }
      return;
    }
  }
}

namespace detail {

// Concatenates the arrays at the same place of every part along `dim`.
inline Nest concat_at(const std::vector<const Nest*>& parts, int64_t dim) {
  const Nest& first = *parts.front();
  switch (first.kind) {
    case Nest::Kind::kArray: {
      Array out = first.array;
      out.shape[dim] = 0;
      for (const Nest* part : parts) out.shape[dim] += part->array.shape[dim];
      out.data = std::make_shared<std::string>(out.nbytes(), '\0');
      // Copy dim-slices: for every index of the dims before `dim`, each part
      // contributes one contiguous run of shape[dim] * inner bytes.
      int64_t outer = 1, inner = out.itemsize();
      for (int64_t d = 0; d < dim; ++d) outer *= out.shape[d];
      for (size_t d = dim + 1; d < out.shape.size(); ++d) inner *= out.shape[d];
      char* dst = out.data->data();
      for (int64_t o = 0; o < outer; ++o) {
        for (const Nest* part : parts) {
          int64_t run = part->array.shape[dim] * inner;
          std::memcpy(dst, part->array.bytes() + o * run, run);
          dst += run;
        }
      }
      return Nest::of(std::move(out));
    }
    case Nest::Kind::kList:
    case Nest::Kind::kTuple: {
      Nest out = first;
      for (size_t i = 0; i < first.items.size(); ++i) {
        std::vector<const Nest*> column;
        for (const Nest* part : parts) column.push_back(&part->items[i]);
        out.items[i] = concat_at(column, dim);
      }
      return out;
    }
    case Nest::Kind::kDict: {
      Nest out = first;
      for (auto& [key, value] : out.fields) {
        std::vector<const Nest*> column;
        for (const Nest* part : parts) column.push_back(&part->fields.at(key));
        value = concat_at(column, dim);
      }
      return out;
    }
  }
  return first;
}

inline void split_at(const Nest& nest, const std::vector<int64_t>& sizes, int64_t dim,
                     std::vector<Nest>* outs) {
  switch (nest.kind) {
    case Nest::Kind::kArray: {
      const Array& in = nest.array;
      int64_t outer = 1, inner = in.itemsize();
      for (int64_t d = 0; d < dim; ++d) outer *= in.shape[d];
      for (size_t d = dim + 1; d < in.shape.size(); ++d) inner *= in.shape[d];
      const char* src = in.bytes();
      std::vector<char*> dsts;
      for (size_t i = 0; i < sizes.size(); ++i) {
        Array a = in;
        a.shape[dim] = sizes[i];
        a.data = std::make_shared<std::string>(a.nbytes(), '\0');
        dsts.push_back(a.data->data());
        (*outs)[i] = Nest::of(std::move(a));
      }
      for (int64_t o = 0; o < outer; ++o) {
        for (size_t i = 0; i < sizes.size(); ++i) {
          int64_t run = sizes[i] * inner;
          std::memcpy(dsts[i] + o * run, src, run);
          src += run;
        }
      }
      return;
    }
    case Nest::Kind::kList:
    case Nest::Kind::kTuple: {
      std::vector<Nest> parts(sizes.size());
      for (Nest& out : *outs) {
        out.kind = nest.kind;
        out.items.resize(nest.items.size());
      }
      for (size_t c = 0; c < nest.items.size(); ++c) {
        split_at(nest.items[c], sizes, dim, &parts);
        for (size_t i = 0; i < sizes.size(); ++i) (*outs)[i].items[c] = std::move(parts[i]);
      }
      return;
    }
    case Nest::Kind::kDict: {
      std::vector<Nest> parts(sizes.size());
      for (Nest& out : *outs) out.kind = Nest::Kind::kDict;
      for (const auto& [key, value] : nest.fields) {
        split_at(value, sizes, dim, &parts);
        for (size_t i = 0; i < sizes.size(); ++i) (*outs)[i].fields[key] = std::move(parts[i]);
      }
      return;
    }
  }
}

}  // namespace detail

// Concatenates nests of the same structure along `dim` into new buffers.
// Throws std::invalid_argument naming the path when they do not fit.
inline Nest concat(const std::vector<const Nest*>& parts, int64_t dim) {
  if (parts.empty()) throw std::invalid_argument("concat: nothing to concatenate");
  for (const Nest* part : parts) {
    batch_size(*part, dim);
    check_concatenable(*parts.front(), *part, dim);
  }
  return detail::concat_at(parts, dim);
}

inline Nest concat(const std::vector<Nest>& parts, int64_t dim) {
  std::vector<const Nest*> pointers;
  for (const Nest& part : parts) pointers.push_back(&part);
  return concat(pointers, dim);
}

// The inverse of concat: cuts every array into sizes[0], sizes[1], ... along
// `dim`. Throws std::invalid_argument if the batch size is not their sum.
inline std::vector<Nest> split(const Nest& nest, const std::vector<int64_t>& sizes, int64_t dim) {
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  int64_t size = batch_size(nest, dim);
  if (size >= 0 && size != total) {
    throw std::invalid_argument("batch size " + std::to_string(size) +
                                " along batch_dim=" + std::to_string(dim) + " does not match the " +
                                std::to_string(total) + " rows of the inputs");
  }
  std::vector<Nest> outs(sizes.size());
  detail::split_at(nest, sizes, dim, &outs);
  return outs;
}

// Remembers the layout of the first nest it sees (structure, dtypes, every
// dimension but the batch one) and checks later nests against it, so that the
// producer of a bad nest gets the error rather than whoever concatenates.
class LayoutCheck {
 public:
  explicit LayoutCheck(int64_t batch_dim) : batch_dim_(batch_dim) {}

  void check(const Nest& nest) {
    batch_size(nest, batch_dim_);
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_) {
      first_ = without_data(nest);
      return;
    }
    try {
      check_concatenable(*first_, nest, batch_dim_);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string(e.what()) + " (first nest vs this one)");
    }
  }

 private:
  // Keeps the layout but not the bytes, which may be large.
  static Nest without_data(Nest nest) {
    nest.array.data.reset();
    for (Nest& item : nest.items) item = without_data(item);
    for (auto& kv : nest.fields) kv.second = without_data(kv.second);
    return nest;
  }

  const int64_t batch_dim_;
  std::mutex mu_;
  std::optional<Nest> first_;  // GUARDED_BY(mu_)
};

// ---------------------------------------------------------------------------
// Python conversion. Callers hold the GIL.

// Copies a Python nest (dict with str keys / list / tuple / numpy array /
// anything np.asarray accepts, such as Python scalars) into C++ buffers.
inline Nest nest_from_python(py::handle obj, const std::string& path = "") {
  if (py::isinstance<py::dict>(obj)) {
    Nest n = Nest::dict({});
    for (auto [key, value] : py::reinterpret_borrow<py::dict>(obj)) {
      if (!py::isinstance<py::str>(key)) {
        throw std::invalid_argument(
            "dict keys must be str " + where(path) + ", got " +
            std::string(py::str(py::type::handle_of(key).attr("__name__"))));
      }
      std::string k = key.cast<std::string>();
      n.fields[k] = nest_from_python(value, path + "['" + k + "']");
    }
    return n;
  }
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    Nest n;
    n.kind = py::isinstance<py::list>(obj) ? Nest::Kind::kList : Nest::Kind::kTuple;
    size_t i = 0;
    for (py::handle item : obj) {
      n.items.push_back(nest_from_python(item, path + "[" + std::to_string(i++) + "]"));
    }
    return n;
  }
  py::array arr = py::array::ensure(obj, py::array::c_style);
  std::string type_name = py::str(py::type::handle_of(obj).attr("__name__"));
  if (!arr) {
    throw std::invalid_argument("cannot convert a " + type_name + " " + where(path) +
                                " to a numpy array");
  }
  Array a;
  a.dtype = canonical_dtype(arr.dtype().num());
  if (a.itemsize() == 0 || arr.dtype().itemsize() != a.itemsize() ||
      !arr.dtype().attr("isnative").cast<bool>()) {
    throw std::invalid_argument("unsupported dtype " + std::string(py::str(arr.dtype())) + " " +
                                where(path) + " (a " + type_name +
                                "); use numeric arrays in native byte order");
  }
  a.shape.assign(arr.shape(), arr.shape() + arr.ndim());
  a.data = std::make_shared<std::string>(static_cast<const char*>(arr.data()), arr.nbytes());
  return Nest::of(std::move(a));
}

// Builds Python objects for a nest: dict / list / tuple / numpy arrays that
// own (a reference to) the C++ buffer, so no bytes are copied.
inline py::object nest_to_python(const Nest& nest) {
  switch (nest.kind) {
    case Nest::Kind::kArray: {
      auto* owner = new std::shared_ptr<std::string>(nest.array.data);
      py::capsule base(owner,
                       [](void* p) { delete static_cast<std::shared_ptr<std::string>*>(p); });
      return py::array(py::dtype(nest.array.dtype), nest.array.shape, (*owner)->data(), base);
    }
    case Nest::Kind::kList: {
      py::list out;
      for (const Nest& item : nest.items) out.append(nest_to_python(item));
      return std::move(out);
    }
    case Nest::Kind::kTuple: {
      py::tuple out(nest.items.size());
      for (size_t i = 0; i < nest.items.size(); ++i) out[i] = nest_to_python(nest.items[i]);
      return std::move(out);
    }
    case Nest::Kind::kDict: {
      py::dict out;
      for (const auto& [key, value] : nest.fields) out[py::str(key)] = nest_to_python(value);
      return std::move(out);
    }
  }
  return py::none();
}

// ---------------------------------------------------------------------------
// Wire conversion (csrc/rpcenv.proto). Lists and tuples both travel as
// `vector` and come back as lists.

// Takes the bytes out of `proto` (no copy) and checks that they fit the
// dtype and shape, since they come from another process.
inline Nest nest_from_proto(rpcenv::ArrayNest* proto, const std::string& path = "") {
  if (proto->has_array()) {
    rpcenv::NDArray* nd = proto->mutable_array();
    Array a;
    a.dtype = canonical_dtype(nd->dtype());
    a.shape.assign(nd->shape().begin(), nd->shape().end());
    int64_t numel = 1;  // checked for overflow: the shape comes from another process
    for (int64_t d : a.shape) {
      if (d < 0 || (d > 0 && numel > (int64_t{1} << 58) / d)) {
        throw std::invalid_argument("received array " + where(path) + " has the impossible shape " +
                                    shape_str(a.shape));
      }
      numel *= d;
    }
    if (a.itemsize() == 0 || static_cast<int64_t>(nd->data().size()) != a.nbytes()) {
      throw std::invalid_argument("received array " + where(path) + " has dtype number " +
                                  std::to_string(nd->dtype()) + ", shape " + shape_str(a.shape) +
                                  " and " + std::to_string(nd->data().size()) +
                                  " bytes, which do not fit together");
    }
    a.data = std::make_shared<std::string>(std::move(*nd->mutable_data()));
    return Nest::of(std::move(a));
  }
  if (proto->map_size() > 0) {
    Nest n = Nest::dict({});
    for (auto& [key, value] : *proto->mutable_map()) {
      n.fields[key] = nest_from_proto(&value, path + "['" + key + "']");
    }
    return n;
  }
  Nest n;
  n.kind = Nest::Kind::kList;
  for (int i = 0; i < proto->vector_size(); ++i) {
    n.items.push_back(
        nest_from_proto(proto->mutable_vector(i), path + "[" + std::to_string(i) + "]"));
  }
  return n;
}

inline void nest_to_proto(const Nest& nest, rpcenv::ArrayNest* proto) {
  switch (nest.kind) {
    case Nest::Kind::kArray: {
      rpcenv::NDArray* nd = proto->mutable_array();
      nd->set_dtype(nest.array.dtype);
      for (int64_t d : nest.array.shape) nd->add_shape(d);
      nd->set_data(nest.array.bytes(), nest.array.nbytes());
      return;
    }
    case Nest::Kind::kList:
    case Nest::Kind::kTuple:
      for (const Nest& item : nest.items) nest_to_proto(item, proto->add_vector());
      return;
    case Nest::Kind::kDict:
      for (const auto& [key, value] : nest.fields)
        nest_to_proto(value, &(*proto->mutable_map())[key]);
      return;
  }
}

}  // namespace beast
